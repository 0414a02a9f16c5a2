//! The crate's statements as literal SQL, each sent as one simple-protocol
//! query (`sqlx::raw_sql`): nothing is prepared on the server, so they work
//! through a transaction pooler (PgBouncer before 1.21 cannot keep SQLx's
//! named statements, and an unnamed one's Parse and Execute may reach two
//! server connections outside a transaction), in one round trip each.

use std::fmt::Write;
use std::time::Duration;

use serde_json::Value;
use uuid::Uuid;

use crate::Error;

/// A text literal, `E'...'` (read the same whatever
/// `standard_conforming_strings` says), cast to `type_name`; `NULL` for
/// `None`. PostgreSQL text cannot hold NUL: such a string is refused here.
pub(crate) fn text(value: Option<&str>, type_name: &str) -> Result<String, Error> {
    let Some(value) = value else { return Ok(format!("NULL::{type_name}")) };
    if value.contains('\0') {
        let why = "PostgreSQL text cannot hold the NUL character this argument contains";
        return Err(Error::InvalidArgument(sqlx::Error::Encode(why.into())));
    }
    let mut literal = String::with_capacity(value.len() + 10);
    literal.push_str("E'");
    for c in value.chars() {
        match c {
            '\'' => literal.push_str("''"),
            '\\' => literal.push_str("\\\\"),
            c => literal.push(c),
        }
    }
    literal.push_str("'::");
    literal.push_str(type_name);
    Ok(literal)
}

/// A bytea literal, in hex.
pub(crate) fn bytea(value: Option<&[u8]>) -> String {
    let Some(value) = value else { return "NULL::bytea".into() };
    let mut literal = String::with_capacity(2 * value.len() + 16);
    literal.push_str("E'\\\\x");
    for byte in value {
        let _ = write!(literal, "{byte:02x}");
    }
    literal.push_str("'::bytea");
    literal
}

/// The bytes that `encode(..., 'hex')` wrote; `None` if it is not hex.
pub(crate) fn from_hex(hex: &str) -> Option<Vec<u8>> {
    let digits = hex.as_bytes();
    if digits.len() % 2 != 0 {
        return None;
    }
    let nibble = |digit: u8| (digit as char).to_digit(16).map(|value| value as u8);
    digits.chunks_exact(2).map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?)).collect()
}

/// An interval literal of exactly this many microseconds; `NULL` for `None`.
pub(crate) fn interval(value: Option<Duration>) -> String {
    match value {
        Some(duration) => format!("'{} microseconds'::interval", duration.as_micros()),
        None => "NULL::interval".into(),
    }
}

/// A jsonb literal; `NULL` for `None`.
pub(crate) fn jsonb(value: Option<&Value>) -> Result<String, Error> {
    text(value.map(Value::to_string).as_deref(), "jsonb")
}

/// A uuid literal; `NULL` for `None`.
pub(crate) fn uuid(value: Option<Uuid>) -> String {
    match value {
        Some(uuid) => format!("'{uuid}'::uuid"),
        None => "NULL::uuid".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_escapes_quotes_and_backslashes() {
        assert_eq!(text(Some(r"a'b\c"), "text").unwrap(), r"E'a''b\\c'::text");
        assert_eq!(text(None, "text").unwrap(), "NULL::text");
        assert!(matches!(text(Some("a\0b"), "text"), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn bytea_is_hex() {
        assert_eq!(bytea(Some(&[0, 0xab, 0x10])), r"E'\\x00ab10'::bytea");
        assert_eq!(bytea(Some(&[])), r"E'\\x'::bytea");
    }

    #[test]
    fn from_hex_reads_what_encode_writes() {
        assert_eq!(from_hex("00ab10FF"), Some(vec![0, 0xab, 0x10, 0xff]));
        assert_eq!(from_hex(""), Some(vec![]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }
}
