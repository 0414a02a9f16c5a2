//! The `Idempotency-Key` field: a Structured Field String (RFC 8941), or a
//! bare token accepted as the same key (docs/http-contract.md).

use http::header::HeaderMap;

/// The name of the request field that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The longest key the extension accepts, in bytes.
const MAX_KEY_BYTES: usize = 255;

/// Reads the key of a request: `Ok(None)` when the field is absent, `Err`
/// with a sentence saying why when it is malformed.
pub fn request_key(headers: &HeaderMap) -> Result<Option<String>, &'static str> {
    let mut fields = headers.get_all(IDEMPOTENCY_KEY).iter();
    let field = match fields.next() {
        None => return Ok(None),
        Some(field) => field,
    };
    if fields.next().is_some() {
        return Err("The Idempotency-Key field is sent more than once.");
    }
    parse_key(field.as_bytes()).map(Some)
}

/// Parses one field value: a quoted string, or a bare token.
pub fn parse_key(field: &[u8]) -> Result<String, &'static str> {
    let value = trim_spaces(field);
    let key = match value.first() {
        None => return Err("The Idempotency-Key field is empty."),
        Some(b'"') => parse_string(value)?,
        Some(_) => parse_bare(value)?,
    };
    if key.is_empty() {
        return Err("The Idempotency-Key is empty.");
    }
    if key.len() > MAX_KEY_BYTES {
        return Err("The Idempotency-Key is longer than 255 bytes.");
    }
    Ok(key)
}

/// Removes the spaces and tabs around a field value.
fn trim_spaces(mut value: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = value {
        value = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = value {
        value = rest;
    }
    value
}

/// Unescapes an sf-string that must fill the whole value.
fn parse_string(value: &[u8]) -> Result<String, &'static str> {
    let mut key = String::new();
    let mut bytes = value[1..].iter();
    while let Some(&byte) = bytes.next() {
        match byte {
            b'"' if bytes.len() == 0 => return Ok(key),
            b'"' => return Err("The Idempotency-Key string is followed by something else."),
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => key.push(escaped as char),
                _ => return Err("The Idempotency-Key string has an escape other than \\\" or \\\\."),
            },
            0x20..=0x7e => key.push(byte as char),
            _ => return Err("The Idempotency-Key string has a character outside printable ASCII."),
        }
    }
    Err("The Idempotency-Key string has no closing double quote.")
}

/// Accepts a bare key made of token characters (and `:` and `/`), not starting with `:`.
fn parse_bare(value: &[u8]) -> Result<String, &'static str> {
    if value[0] == b':' || !value.iter().all(|&b| is_bare_key_char(b)) {
        return Err("The Idempotency-Key is neither a quoted string nor a bare token.");
    }
    Ok(value.iter().map(|&b| b as char).collect())
}

/// True for RFC 9110 tchar, `:` and `/`.
fn is_bare_key_char(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&byte)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_strings_unescape() {
        assert_eq!(parse_key(b"\"abc\"").unwrap(), "abc");
        assert_eq!(parse_key(b" \t\"a b\" ").unwrap(), "a b");
        assert_eq!(parse_key(br#""say \"hi\" \\ bye""#).unwrap(), r#"say "hi" \ bye"#);
    }

    #[test]
    fn bare_tokens_are_the_same_key() {
        assert_eq!(parse_key(b"abc").unwrap(), parse_key(b"\"abc\"").unwrap());
        for bare in ["8e03978e-40d5-43e8-bc93-6894a57f9324", "42", "4.5", "a:b/c", "*x", " tok "] {
            assert_eq!(parse_key(bare.as_bytes()).unwrap(), bare.trim(), "{}", bare);
        }
    }

    #[test]
    fn malformed_fields_are_refused() {
        let long = format!("\"{}\"", "k".repeat(256));
        for bad in [
            "", " ", "\"unterminated", "\"abc\";x=1", "\"a\" x", "?1", ":YWJj:", "(a b)", "\"\"", "\"a\\qb\"",
            "\"a\", \"b\"", "a b", "a,b", "\"tab\there\"", "\"é\"", "a\"b", &long,
        ] {
            assert!(parse_key(bad.as_bytes()).is_err(), "{:?} was accepted", bad);
        }
        assert!(parse_key(b"\"\xff\"").is_err());
        assert!(parse_key(format!("\"{}\"", "k".repeat(255)).as_bytes()).is_ok());
    }

    #[test]
    fn the_field_counts_once() {
        let mut headers = HeaderMap::new();
        assert_eq!(request_key(&headers), Ok(None));
        headers.append(IDEMPOTENCY_KEY, "\"a\"".parse().unwrap());
        assert_eq!(request_key(&headers), Ok(Some("a".to_string())));
        headers.append(IDEMPOTENCY_KEY, "\"a\"".parse().unwrap());
        assert!(request_key(&headers).is_err());
    }
}
