//! The few `pgoutput` messages the WAL source reads (protocol version 1, values as text):
//! `Relation`, which names a table's columns, and `Insert`, one new row. Everything else in the
//! stream (updates, deletes, truncates, types, origins) is skipped: the outbox is insert-only for
//! this source, and its publication publishes inserts only.
//!
//! Format: <https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html>.

use bytes::{Buf, Bytes};
use std::collections::HashMap;

/// One decoded change.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// A new row of the table `relation` names, its values in the relation's column order.
    Insert {
        /// The relation's id, from an earlier [`Relation`] message.
        relation: u32,
        /// Column values.
        values: Vec<Value>,
    },
    /// A message this source does not need.
    Other,
}

/// A column value of a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    /// SQL NULL.
    Null,
    /// A TOASTed value that did not change (never in an insert).
    Unchanged,
    /// The value's text form, shared with the message it came in (not copied).
    Text(Bytes),
}

/// A table, as a `Relation` message describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Relation {
    pub namespace: String,
    pub name: String,
    pub columns: Vec<String>,
}

/// Decodes a stream's messages, remembering the relations it has seen (the server sends a
/// table's `Relation` before the first change of it in each session, and again after it changes).
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    relations: HashMap<u32, Relation>,
}

impl Decoder {
    /// Decodes one `XLogData` payload. A `Relation` is remembered and returned as `Other`.
    pub fn decode(&mut self, mut data: Bytes) -> Result<Change, String> {
        if !data.has_remaining() {
            return Err("empty pgoutput message".into());
        }
        match data.get_u8() {
            b'R' => {
                let id = u32_of(&mut data)?;
                let namespace = string(&mut data)?;
                let name = string(&mut data)?;
                need(&data, 3)?;
                let _replica_identity = data.get_u8();
                let count = data.get_i16();
                let mut columns = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
                for _ in 0..count {
                    need(&data, 1)?;
                    let _flags = data.get_u8();
                    columns.push(string(&mut data)?);
                    need(&data, 8)?;
                    let _type_oid = data.get_u32();
                    let _type_modifier = data.get_i32();
                }
                self.relations.insert(
                    id,
                    Relation {
                        namespace,
                        name,
                        columns,
                    },
                );
                Ok(Change::Other)
            }
            b'I' => {
                let relation = u32_of(&mut data)?;
                need(&data, 1)?;
                if data.get_u8() != b'N' {
                    return Err("insert without a new tuple".into());
                }
                Ok(Change::Insert {
                    relation,
                    values: tuple(&mut data)?,
                })
            }
            _ => Ok(Change::Other),
        }
    }

    /// The relation an `Insert` refers to.
    pub fn relation(&self, id: u32) -> Option<&Relation> {
        self.relations.get(&id)
    }
}

fn need(data: &Bytes, n: usize) -> Result<(), String> {
    if data.remaining() < n {
        Err(format!(
            "truncated pgoutput message: {n} more bytes expected, {} left",
            data.remaining()
        ))
    } else {
        Ok(())
    }
}

fn u32_of(data: &mut Bytes) -> Result<u32, String> {
    need(data, 4)?;
    Ok(data.get_u32())
}

/// A NUL-terminated string.
fn string(data: &mut Bytes) -> Result<String, String> {
    let end = data
        .iter()
        .position(|b| *b == 0)
        .ok_or("unterminated string in a pgoutput message")?;
    let s = String::from_utf8(data.split_to(end).to_vec())
        .map_err(|_| "a pgoutput name is not UTF-8".to_owned())?;
    data.advance(1);
    Ok(s)
}

fn tuple(data: &mut Bytes) -> Result<Vec<Value>, String> {
    need(data, 2)?;
    let count = data.get_i16();
    let mut values = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    for _ in 0..count {
        need(data, 1)?;
        values.push(match data.get_u8() {
            b'n' => Value::Null,
            b'u' => Value::Unchanged,
            b't' => {
                let len = usize::try_from(u32_of(data)?).map_err(|e| e.to_string())?;
                need(data, len)?;
                Value::Text(data.split_to(len))
            }
            kind => {
                return Err(format!(
                    "column value of kind `{}`: the WAL source reads values as text",
                    kind as char
                ));
            }
        });
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};

    fn relation_message(id: u32, columns: &[&str]) -> Bytes {
        let mut m = BytesMut::new();
        m.put_u8(b'R');
        m.put_u32(id);
        m.put_slice(b"public\0outbox\0");
        m.put_u8(b'd');
        m.put_i16(i16::try_from(columns.len()).unwrap());
        for c in columns {
            m.put_u8(0);
            m.put_slice(c.as_bytes());
            m.put_u8(0);
            m.put_u32(25);
            m.put_i32(-1);
        }
        m.freeze()
    }

    fn insert_message(id: u32, values: &[Option<&str>]) -> Bytes {
        let mut m = BytesMut::new();
        m.put_u8(b'I');
        m.put_u32(id);
        m.put_u8(b'N');
        m.put_i16(i16::try_from(values.len()).unwrap());
        for v in values {
            match v {
                None => m.put_u8(b'n'),
                Some(text) => {
                    m.put_u8(b't');
                    m.put_u32(u32::try_from(text.len()).unwrap());
                    m.put_slice(text.as_bytes());
                }
            }
        }
        m.freeze()
    }

    #[test]
    fn a_relation_then_its_inserts() {
        let mut decoder = Decoder::default();
        assert_eq!(
            decoder.decode(relation_message(16384, &["id", "payload", "topic"])),
            Ok(Change::Other)
        );
        let relation = decoder.relation(16384).unwrap();
        assert_eq!(
            (relation.namespace.as_str(), relation.name.as_str()),
            ("public", "outbox")
        );
        assert_eq!(relation.columns, ["id", "payload", "topic"]);
        let change = decoder
            .decode(insert_message(
                16384,
                &[Some("e-1"), Some(r#"{"a": 1}"#), None],
            ))
            .unwrap();
        assert_eq!(
            change,
            Change::Insert {
                relation: 16384,
                values: vec![
                    Value::Text(Bytes::from_static(b"e-1")),
                    Value::Text(Bytes::from_static(br#"{"a": 1}"#)),
                    Value::Null,
                ],
            }
        );
    }

    #[test]
    fn other_messages_are_skipped_and_broken_ones_are_errors() {
        let mut decoder = Decoder::default();
        assert_eq!(
            decoder.decode(Bytes::from_static(b"U\0\0\0\x01")),
            Ok(Change::Other)
        );
        assert!(decoder.decode(Bytes::new()).is_err());
        let whole = insert_message(7, &[Some("abcdef")]);
        for cut in 1..whole.len() {
            assert!(
                decoder.decode(whole.slice(..cut)).is_err(),
                "cut at {cut} decoded"
            );
        }
        let mut binary = BytesMut::from(&b"I\0\0\0\x07N\0\x01b"[..]);
        binary.put_u32(0);
        assert!(
            decoder
                .decode(binary.freeze())
                .unwrap_err()
                .contains("as text")
        );
    }
}
