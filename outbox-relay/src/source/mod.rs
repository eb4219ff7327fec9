//! Where the events come from: the outbox table, claimed batch by batch (`table`), or the
//! write-ahead log, read through logical replication (`wal`).

pub(crate) mod table;
pub mod wal;
