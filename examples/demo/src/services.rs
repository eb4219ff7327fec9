//! The demo's processes: started from the binaries beside this one, their output kept in files
//! and shown when something goes wrong, stopped with SIGTERM (or killed) at the end.

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::{AnyError, PATIENCE};

/// One running service.
pub struct Service {
    name: &'static str,
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Service {
    /// Starts binary `name` (found beside `outbox-demo`) with `args` and extra environment.
    pub fn start(
        name: &'static str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self, AnyError> {
        let here = std::env::current_exe()?;
        let binary = here.with_file_name(name);
        if !binary.exists() {
            return Err(format!(
                "{} is missing: build it with `cargo build -p orders-service -p billing-service -p shop-relay` (scripts/demo does)",
                binary.display()
            )
            .into());
        }
        let logs = logs();
        std::fs::create_dir_all(&logs)?;
        // A restarted service writes new files: the first run's output stays readable.
        static STARTS: AtomicUsize = AtomicUsize::new(0);
        let start = STARTS.fetch_add(1, Ordering::Relaxed);
        let stdout = logs.join(format!("{name}-{start}.out"));
        let stderr = stdout.with_extension("err");
        let child = Command::new(&binary)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout)?)
            .stderr(std::fs::File::create(&stderr)?)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        Ok(Service {
            name,
            child,
            stdout,
            stderr,
        })
    }

    /// SIGKILL: the process gets no chance to finish anything, as in a crash.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits for a clean exit.
    pub fn stop(&mut self) -> Result<(), AnyError> {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()?;
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait()? {
                if !status.success() {
                    return Err(self.failure(&format!("exited with {status} when stopped")));
                }
                println!("  {} stopped ({status})", self.name);
                return Ok(());
            }
            if Instant::now() > deadline {
                self.kill();
                return Err(self.failure("did not stop within a minute of SIGTERM"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the service printed on stdout.
    pub fn stdout(&self) -> std::io::Result<String> {
        std::fs::read_to_string(&self.stdout)
    }

    /// An error naming the service, with the end of its output.
    fn failure(&self, what: &str) -> AnyError {
        let tail = |path: &PathBuf| {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(20)..].join("\n    ")
        };
        format!(
            "{} {what}\n  its stdout:\n    {}\n  its stderr:\n    {}",
            self.name,
            tail(&self.stdout),
            tail(&self.stderr)
        )
        .into()
    }
}

impl Drop for Service {
    /// A demo that fails half-way leaves no process behind.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}

/// Where the services' output goes while the demo runs.
fn logs() -> PathBuf {
    std::env::temp_dir().join(format!("outbox-demo-{}", std::process::id()))
}

/// Removes the services' output.
pub fn remove_logs() {
    let _ = std::fs::remove_dir_all(logs());
}

/// Waits until `url` answers 200, failing early, with the service's output, if it exits.
pub async fn wait_ready(
    http: &reqwest::Client,
    service: &mut Service,
    url: &str,
) -> Result<(), AnyError> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Ok(response) = http.get(url).send().await
            && response.status().is_success()
        {
            return Ok(());
        }
        if service.child.try_wait()?.is_some() || Instant::now() > deadline {
            return Err(service.failure(&format!("was not ready at {url}")));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A free loopback address for a service to listen on.
pub fn free_address() -> std::io::Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.to_string())
}

/// Creates `topics` with 3 partitions each, unless they exist: as a team would before deploying,
/// rather than relying on the broker creating them on first use.
pub async fn create_topics(brokers: &str, topics: &[&str]) -> Result<(), AnyError> {
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|topic| NewTopic::new(topic, 3, TopicReplication::Fixed(1)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for result in admin.create_topics(&new, &options).await? {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(format!("cannot create topic {topic}: {code}").into()),
        }
    }
    Ok(())
}
