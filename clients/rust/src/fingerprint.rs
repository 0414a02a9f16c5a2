//! The request fingerprint, computed here exactly as `idempotency.fingerprint()`
//! computes it in the database (fingerprint.c), so that a claim sends 32
//! bytes instead of the whole body.

use sha2::{Digest, Sha256};

/// SHA-256 of a request: the method (ASCII upper-cased), the path, the body
/// and the query, each written as a presence byte, an 8-byte big-endian
/// length and the bytes. `None` (no body, no query) differs from empty.
pub fn fingerprint(method: &str, path: &str, body: Option<&[u8]>, query: Option<&str>) -> [u8; 32] {
    let mut hash = Sha256::new();
    digest_part(&mut hash, Some(method.to_ascii_uppercase().as_bytes()));
    digest_part(&mut hash, Some(path.as_bytes()));
    digest_part(&mut hash, body);
    digest_part(&mut hash, query.map(str::as_bytes));
    hash.finalize().into()
}

/// Feeds one part, or its absence, to the hash.
fn digest_part(hash: &mut Sha256, part: Option<&[u8]>) {
    let (present, bytes) = match part {
        Some(bytes) => (1u8, bytes),
        None => (0u8, &[][..]),
    };
    hash.update([present]);
    hash.update((bytes.len() as u64).to_be_bytes());
    hash.update(bytes);
}

#[cfg(test)]
mod tests {
    use super::fingerprint;

    #[test]
    fn parts_do_not_run_into_each_other() {
        assert_ne!(fingerprint("POST", "/a", Some(b"bc"), None), fingerprint("POST", "/ab", Some(b"c"), None));
        assert_ne!(fingerprint("POST", "/a", None, None), fingerprint("POST", "/a", Some(b""), None));
        assert_ne!(fingerprint("POST", "/a", None, None), fingerprint("POST", "/a", None, Some("")));
        assert_eq!(fingerprint("post", "/a", None, None), fingerprint("POST", "/a", None, None));
    }
}
