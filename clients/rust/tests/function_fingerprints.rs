//! The shared vectors of clients/testdata/function-fingerprints.json (its
//! path in FUNCTION_FINGERPRINTS, set by ./test): the function's fingerprint
//! of each vector's arguments is the one every client makes of them.

use pg_idempotency::arguments_fingerprint;
use serde_json::Value;

#[test]
fn the_fingerprint_every_client_makes() {
    let path = std::env::var("FUNCTION_FINGERPRINTS").expect("FUNCTION_FINGERPRINTS names the vectors' file");
    let file: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("the vectors' file")).expect("JSON");
    let vectors = file["vectors"].as_array().expect("vectors");
    assert!(!vectors.is_empty());
    for vector in vectors {
        let arguments: Value = serde_json::from_str(vector["arguments"].as_str().unwrap()).expect("arguments");
        let hex: String = arguments_fingerprint(&arguments).unwrap().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, vector["sha256"].as_str().unwrap(), "{}: want the SHA-256 of {}", vector["name"], vector["canonical"]);
    }
}
