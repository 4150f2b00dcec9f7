//! Property tests over key validation and token encodings: never a panic, and distinct inputs
//! stay distinct.

use lock_core::{LockKey, OwnershipToken};
use proptest::prelude::*;

proptest! {
    #[test]
    fn any_string_gets_a_key_or_a_typed_error(s in any::<String>()) {
        match LockKey::new(&s) {
            Ok(key) => {
                prop_assert_eq!(key.as_str(), s.as_str());
                prop_assert!(!s.is_empty() && s.len() <= LockKey::MAX_LEN);
                prop_assert!(!s.chars().any(char::is_control));
            }
            Err(lock_core::Error::InvalidKey { .. }) => {
                prop_assert!(s.is_empty() || s.len() > LockKey::MAX_LEN || s.chars().any(char::is_control));
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }

    #[test]
    fn tokens_round_trip_and_digests_hide_them(bytes in any::<[u8; 16]>()) {
        let token = OwnershipToken::from_bytes(bytes);
        prop_assert_eq!(OwnershipToken::from_hex(&token.expose_hex()).unwrap(), token);
        let shown = format!("{token:?} {token}");
        prop_assert!(!shown.contains(&token.expose_hex()));
    }

    #[test]
    fn hex_parsing_never_panics(s in ".{0,40}") {
        let _ = OwnershipToken::from_hex(&s);
    }
}
