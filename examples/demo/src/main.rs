//! The outbox demo: a shop of three processes, driven with real HTTP requests.
//!
//! - `orders-service` (axum + SeaORM) changes orders and records their events in the same
//!   transactions;
//! - `shop-relay` publishes the orders database's outbox to Kafka;
//! - `billing-service` consumes the order events and bills each order once, through its inbox.
//!
//! `outbox-demo` needs PostgreSQL at `DATABASE_URL` and Kafka at `KAFKA_BROKERS` (`scripts/demo`
//! starts both on loopback); `outbox-demo --mariadb` the same story on MariaDB (or MySQL) at
//! `MARIADB_URL` (`scripts/demo --mariadb`). `outbox-demo --sqlite` needs neither: the order
//! service on SQLite, and the relay printing what it would publish.
//!
//! The three binaries are found beside this one (`cargo build` puts them there).
//! `OUTBOX_DEMO_TOPIC_TEMPLATE` gives the relay another topic template, so that a test sharing a
//! broker reads only its own events.

mod services;

use rdkafka::Message as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use seaorm_outbox::TableName;
use seaorm_outbox::sea_orm::{ConnectionTrait, Database, DatabaseConnection, DbBackend, Statement};
use serde_json::{Value, json};
use services::{Service, free_address};
use std::time::{Duration, Instant};

type AnyError = Box<dyn std::error::Error>;

/// How long any one wait of the demo may take.
const PATIENCE: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> Result<(), AnyError> {
    let told = if std::env::args().any(|a| a == "--sqlite") {
        sqlite_story().await
    } else if std::env::args().any(|a| a == "--mariadb") {
        story(Server::MariaDb).await
    } else {
        story(Server::Postgres).await
    };
    // The services' output was shown where something failed; it goes with them.
    services::remove_logs();
    told
}

/// The database server the services' databases are made on.
#[derive(Clone, Copy, PartialEq)]
enum Server {
    Postgres,
    MariaDb,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Server::Postgres => "PostgreSQL",
            Server::MariaDb => "MariaDB",
        }
    }

    /// The billing service's consumer name (its inbox's and its Kafka group's).
    fn consumer(self) -> &'static str {
        match self {
            Server::Postgres => "billing",
            Server::MariaDb => "billing-mariadb",
        }
    }

    /// The server's URL, from `DATABASE_URL` or `MARIADB_URL`.
    fn url(self) -> Result<String, AnyError> {
        let (variable, script) = match self {
            Server::Postgres => ("DATABASE_URL", "scripts/demo"),
            Server::MariaDb => ("MARIADB_URL", "scripts/demo --mariadb"),
        };
        std::env::var(variable).map_err(|_| {
            format!(
                "{variable} is not set: run {script}, which starts {}",
                self.name()
            )
            .into()
        })
    }
}

/// The story on PostgreSQL (or MariaDB) and Kafka.
async fn story(kind: Server) -> Result<(), AnyError> {
    let server = kind.url()?;
    let brokers = std::env::var("KAFKA_BROKERS")
        .map_err(|_| "KAFKA_BROKERS is not set: run scripts/demo, which starts Kafka")?;
    let template = std::env::var("OUTBOX_DEMO_TOPIC_TEMPLATE")
        .unwrap_or_else(|_| seaorm_outbox_relay::DEFAULT_TOPIC_TEMPLATE.into());
    let order_topic = template.replace("{aggregate_type}", "order");

    println!(
        "== The shop: two services, a relay, {} and Kafka\n",
        kind.name()
    );
    let orders_db = fresh_database(kind, &server, "shop_orders").await?;
    let billing_db = fresh_database(kind, &server, "shop_billing").await?;
    services::create_topics(
        &brokers,
        &[&order_topic, "shop.shipping", "billing.dead-letter"],
    )
    .await?;
    let http = reqwest::Client::new();
    let (orders, orders_url) = start_orders(&http, &orders_db).await?;
    let billing_addr = free_address()?;
    let mut billing = Service::start(
        "billing-service",
        &[],
        &[
            ("DATABASE_URL", &billing_db),
            ("KAFKA_BROKERS", &brokers),
            ("BILLING_ADDR", &billing_addr),
            ("BILLING_TOPIC", &order_topic),
            // A group of its own per server: stories on two servers may share one Kafka.
            ("BILLING_CONSUMER", kind.consumer()),
        ],
    )?;
    let relay_addr = free_address()?;
    let relay_args = [
        "run",
        "--database-url",
        &orders_db,
        "--kafka-brokers",
        &brokers,
        "--topic-template",
        &template,
        "--http-addr",
        &relay_addr,
    ];
    let mut relay = Service::start("shop-relay", &relay_args, &[])?;
    let billing_url = format!("http://{billing_addr}");
    services::wait_ready(&http, &mut billing, &format!("{billing_url}/healthz")).await?;
    services::wait_ready(&http, &mut relay, &format!("http://{relay_addr}/readyz")).await?;
    println!("  orders-service   {orders_url}   database shop_orders: orders + outbox");
    println!("  billing-service  {billing_url}   database shop_billing: invoices + inbox");
    println!("  shop-relay       publishes shop_orders' outbox to Kafka at {brokers}");
    let db = Database::connect(&orders_db).await?;

    println!("\n== 1. A customer places an order\n");
    let ada = place(&http, &orders_url, "ada", 1999).await?;
    println!("  The order row and its OrderPlaced event committed in one transaction.");

    println!("\n== 2. A bad request is refused, and records nothing\n");
    let (status, _) = request(
        &http,
        "POST",
        &format!("{orders_url}/orders"),
        json!({ "customer": "mallory", "total_cents": -5 }),
    )
    .await?;
    expect(status == 422, "the bad order was not refused with 422")?;
    println!(
        "  The handler refused before its transaction did anything: the outbox still holds {} event.",
        outbox_rows(&db).await?
    );

    println!("\n== 3. The relay published the event to Kafka\n");
    let event_id = event_of(&db, &ada, "OrderPlaced").await?;
    show_message(&brokers, &order_topic, &event_id).await?;

    println!("\n== 4. Billing consumed it, through its inbox\n");
    wait_for_invoice(&http, &billing_url, &ada, "open").await?;

    println!("\n== 5. The relay crashes; the shop keeps taking orders\n");
    relay.kill();
    println!("  kill -9 shop-relay\n");
    let grace = place(&http, &orders_url, "grace", 4500).await?;
    let path = format!("{orders_url}/orders/{ada}/ship");
    request(&http, "POST", &path, json!({ "carrier": "dhl" })).await?;
    let path = format!("{orders_url}/orders/{grace}/cancel");
    request(
        &http,
        "POST",
        &path,
        json!({ "reason": "found it cheaper" }),
    )
    .await?;
    let status = seaorm_outbox_relay::status(&orders_db, &TableName::DEFAULT).await?;
    println!(
        "\n  The events committed with their changes and wait in the outbox: {} unpublished.",
        status.backlog
    );
    let (code, _) = request(
        &http,
        "GET",
        &format!("{billing_url}/invoices/{grace}"),
        Value::Null,
    )
    .await?;
    expect(
        code == 404,
        "billing knew of grace's order before the relay was back",
    )?;
    println!("\n  The relay restarts and resumes where it stopped:");
    relay = Service::start("shop-relay", &relay_args, &[])?;
    services::wait_ready(&http, &mut relay, &format!("http://{relay_addr}/readyz")).await?;
    wait_for_invoice(&http, &billing_url, &grace, "void").await?;
    wait_for_backlog(&orders_db, 0).await?;
    println!(
        "  Nothing was lost: the outbox is drained, and grace's order was billed, then voided, in order."
    );

    println!("\n== 6. A message delivered twice is applied once\n");
    println!(
        "  A relay that crashes after Kafka acked but before it marked the row sends the event again.\n  As if it had: the outbox row of ada's OrderPlaced is made unpublished.\n"
    );
    let stats: Value = http
        .get(format!("{billing_url}/stats"))
        .send()
        .await?
        .json()
        .await?;
    let duplicates_before = stats["duplicates"].as_u64().unwrap_or_default();
    db.execute_unprepared(&format!(
        "UPDATE outbox SET published_at = NULL WHERE id = '{event_id}'"
    ))
    .await?;
    wait_for_backlog(&orders_db, 0).await?;
    let stats = wait_for_duplicate(&http, &billing_url, duplicates_before).await?;
    println!("  $ curl {billing_url}/stats\n  200 {stats}");
    wait_for_invoice(&http, &billing_url, &ada, "open").await?;
    println!("  The inbox skipped the duplicate: ada was billed once.");

    println!("\n== Done: the services stop gracefully\n");
    for mut service in [relay, billing, orders] {
        service.stop()?;
    }
    Ok(())
}

/// The story without services: the order service on SQLite, the relay printing to stdout.
async fn sqlite_story() -> Result<(), AnyError> {
    let path = std::env::temp_dir().join(format!("outbox-demo-{}.db", std::process::id()));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    println!(
        "== The shop on SQLite ({}): no broker, so the relay prints what it would publish",
        path.display()
    );
    println!("   (billing consumes from a broker: run scripts/demo without --sqlite to see it)\n");
    let http = reqwest::Client::new();
    let (mut orders, orders_url) = start_orders(&http, &url).await?;

    println!("== 1. Orders, and a bad request that records nothing\n");
    let ada = place(&http, &orders_url, "ada", 1999).await?;
    let new_order = format!("{orders_url}/orders");
    let body = json!({ "customer": "", "total_cents": 10 });
    let (status, _) = request(&http, "POST", &new_order, body).await?;
    expect(status == 422, "the bad order was not refused with 422")?;
    let ship = format!("{orders_url}/orders/{ada}/ship");
    request(&http, "POST", &ship, json!({ "carrier": "dhl" })).await?;
    println!(
        "\n  {}",
        seaorm_outbox_relay::status(&url, &TableName::DEFAULT)
            .await?
            .to_string()
            .replace('\n', "\n  ")
    );

    println!("\n== 2. The relay publishes what committed, one JSON line per event\n");
    let relay_args = [
        "run",
        "--database-url",
        &url,
        "--sink",
        "stdout",
        "--http-addr",
        "off",
    ];
    let mut relay = Service::start("shop-relay", &relay_args, &[])?;
    wait_for_backlog(&url, 0).await?;
    relay.stop()?;
    println!("  What it printed:");
    for line in relay.stdout()?.lines() {
        println!("  {line}");
    }
    orders.stop()?;
    for suffix in ["", "-wal", "-shm", ".relay-lock"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(())
}

/// Starts the order service on the database at `database_url` and waits until it answers; the
/// service and its base URL.
async fn start_orders(
    http: &reqwest::Client,
    database_url: &str,
) -> Result<(Service, String), AnyError> {
    let addr = free_address()?;
    let env = [("DATABASE_URL", database_url), ("ORDERS_ADDR", &addr)];
    let mut orders = Service::start("orders-service", &[], &env)?;
    let url = format!("http://{addr}");
    services::wait_ready(http, &mut orders, &format!("{url}/healthz")).await?;
    Ok((orders, url))
}

/// A new, empty database `name` on the server of `server_url`; its URL.
async fn fresh_database(kind: Server, server_url: &str, name: &str) -> Result<String, AnyError> {
    let server = Database::connect(server_url).await?;
    let drop = match kind {
        Server::Postgres => format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        Server::MariaDb => format!("DROP DATABASE IF EXISTS {name}"),
    };
    server.execute_unprepared(&drop).await?;
    server
        .execute_unprepared(&format!("CREATE DATABASE {name}"))
        .await?;
    let (base, _) = server_url
        .rsplit_once('/')
        .ok_or("DATABASE_URL has no database name")?;
    Ok(format!("{base}/{name}"))
}

/// `POST /orders`; the new order's id.
async fn place(
    http: &reqwest::Client,
    orders_url: &str,
    customer: &str,
    total_cents: i64,
) -> Result<String, AnyError> {
    let body = json!({ "customer": customer, "total_cents": total_cents });
    let (status, order) = request(http, "POST", &format!("{orders_url}/orders"), body).await?;
    expect(status == 201, "the order was not created")?;
    Ok(order["id"]
        .as_str()
        .ok_or("the order has no id")?
        .to_owned())
}

/// Sends one request, printing it as a curl command and its answer.
async fn request(
    http: &reqwest::Client,
    method: &str,
    url: &str,
    body: Value,
) -> Result<(u16, Value), AnyError> {
    let request = match method {
        "GET" => {
            println!("  $ curl {url}");
            http.get(url)
        }
        _ => {
            println!("  $ curl -X {method} {url} -d '{body}'");
            http.post(url).json(&body)
        }
    };
    let response = request.send().await?;
    let status = response.status().as_u16();
    let answer: Value = response.json().await?;
    println!("  {status} {answer}");
    Ok((status, answer))
}

fn expect(condition: bool, otherwise: &str) -> Result<(), AnyError> {
    if condition {
        Ok(())
    } else {
        Err(otherwise.into())
    }
}

async fn outbox_rows(db: &DatabaseConnection) -> Result<i64, AnyError> {
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT count(*) FROM outbox",
        ))
        .await?
        .ok_or("no count")?;
    Ok(row.try_get_by_index(0)?)
}

/// The id of the `event_type` event that order `order_id` recorded.
async fn event_of(
    db: &DatabaseConnection,
    order_id: &str,
    event_type: &str,
) -> Result<String, AnyError> {
    let backend = db.get_database_backend();
    let sql = match backend {
        DbBackend::MySql => "SELECT id FROM outbox WHERE aggregate_id = ? AND event_type = ?",
        _ => "SELECT id::text FROM outbox WHERE aggregate_id = $1 AND event_type = $2",
    };
    let row = db
        .query_one_raw(Statement::from_sql_and_values(
            backend,
            sql,
            [order_id.into(), event_type.into()],
        ))
        .await?
        .ok_or("the event is not in the outbox")?;
    Ok(row.try_get_by_index(0)?)
}

/// Reads `topic` from the beginning, as any Kafka client would, and shows the message of event
/// `event_id`.
async fn show_message(brokers: &str, topic: &str, event_id: &str) -> Result<(), AnyError> {
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("outbox-demo-{}", std::process::id()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()?;
    consumer.subscribe(&[topic])?;
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        let Some(message) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let message = message?;
        let headers: Vec<(String, String)> = message
            .headers()
            .map(|headers| {
                headers
                    .iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        if !headers.iter().any(|(k, v)| k == "id" && v == event_id) {
            continue;
        }
        let text =
            |bytes: Option<&[u8]>| String::from_utf8_lossy(bytes.unwrap_or_default()).into_owned();
        println!(
            "  topic {topic}, partition {}, offset {}",
            message.partition(),
            message.offset()
        );
        println!(
            "    key      {}  (the order id: one order's events stay in one partition, in order)",
            text(message.key())
        );
        let headers: Vec<String> = headers.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("    headers  {}", headers.join(", "));
        println!("    value    {}", text(message.payload()));
        return Ok(());
    }
    Err(format!("event {event_id} did not reach {topic} within {PATIENCE:?}").into())
}

/// Asks billing for the invoice of `order_id` until it has status `status`.
async fn wait_for_invoice(
    http: &reqwest::Client,
    billing_url: &str,
    order_id: &str,
    status: &str,
) -> Result<(), AnyError> {
    let url = format!("{billing_url}/invoices/{order_id}");
    let deadline = Instant::now() + PATIENCE;
    loop {
        let response = http.get(&url).send().await?;
        let code = response.status().as_u16();
        let invoice: Value = response.json().await?;
        if invoice["status"] == status {
            println!("  $ curl {url}\n  {code} {invoice}");
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no {status} invoice for order {order_id} within {PATIENCE:?}: {code} {invoice}"
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until billing's consumer loop has skipped one more duplicate than `before`; its stats.
async fn wait_for_duplicate(
    http: &reqwest::Client,
    billing_url: &str,
    before: u64,
) -> Result<Value, AnyError> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let stats: Value = http
            .get(format!("{billing_url}/stats"))
            .send()
            .await?
            .json()
            .await?;
        if stats["duplicates"].as_u64() > Some(before) {
            return Ok(stats);
        }
        if Instant::now() > deadline {
            return Err(
                format!("billing skipped no duplicate within {PATIENCE:?}: {stats}").into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the outbox at `url` has `backlog` unpublished events.
async fn wait_for_backlog(url: &str, backlog: i64) -> Result<(), AnyError> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let status = seaorm_outbox_relay::status(url, &TableName::DEFAULT).await?;
        if status.backlog == backlog {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the outbox still has {} unpublished events after {PATIENCE:?}",
                status.backlog
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
