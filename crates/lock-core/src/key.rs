//! Lock keys, validated once before any I/O.

use std::{fmt, str::FromStr, sync::Arc};

use crate::{Error, Result};

/// The name of a lock, shared by every instance that must exclude each other.
///
/// Validated on construction, before any I/O: 1 to [`LockKey::MAX_LEN`] bytes of UTF-8 without
/// control characters (NUL, newline, …). Spaces, punctuation, slashes, braces and any other
/// Unicode are allowed; every driver maps each distinct key to a distinct, collision-free name in
/// its own namespace (`"a"` never collides with or queues behind `"a/b"`).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(Arc<str>);

impl LockKey {
    /// The longest key accepted, in bytes.
    pub const MAX_LEN: usize = 512;

    /// Validates `name` and wraps it.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when `name` is empty, longer than [`LockKey::MAX_LEN`] bytes or
    /// contains a control character.
    pub fn new(name: impl AsRef<str>) -> Result<Self> {
        let name = name.as_ref();
        if name.is_empty() {
            return Err(invalid("the key is empty"));
        }
        if name.len() > Self::MAX_LEN {
            return Err(invalid(format!(
                "the key is {} bytes long; at most {} are allowed",
                name.len(),
                Self::MAX_LEN
            )));
        }
        if let Some((at, c)) = name.char_indices().find(|(_, c)| c.is_control()) {
            return Err(invalid(format!(
                "the key contains the control character {:?} at byte {at}",
                c
            )));
        }
        Ok(Self(Arc::from(name)))
    }

    /// The key as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn invalid(reason: impl Into<String>) -> Error {
    Error::InvalidKey {
        reason: reason.into(),
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LockKey({:?})", &*self.0)
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for LockKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for LockKey {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::new(s)
    }
}

impl TryFrom<&str> for LockKey {
    type Error = Error;
    fn try_from(s: &str) -> Result<Self> {
        Self::new(s)
    }
}

impl TryFrom<String> for LockKey {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        Self::new(s)
    }
}

impl TryFrom<&String> for LockKey {
    type Error = Error;
    fn try_from(s: &String) -> Result<Self> {
        Self::new(s)
    }
}

impl TryFrom<&LockKey> for LockKey {
    type Error = Error;
    fn try_from(k: &LockKey) -> Result<Self> {
        Ok(k.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_and_unusual_names() {
        for name in [
            "a",
            "a/b",
            "orders:close",
            "{tag} x",
            "ünï/çødé",
            "..",
            "/",
            "zookeeper",
        ] {
            let key = LockKey::new(name).unwrap();
            assert_eq!(key.as_str(), name);
            // What error messages, the CLI and drivers' names print and read: the key as given.
            assert_eq!(key.to_string(), name);
            assert_eq!(AsRef::<str>::as_ref(&key), name);
            assert_eq!(format!("{key:?}"), format!("LockKey({name:?})"));
        }
        assert!(LockKey::new("x".repeat(LockKey::MAX_LEN)).is_ok());
    }

    #[test]
    fn rejects_bad_names_with_a_typed_error() {
        for name in [
            String::new(),
            "x".repeat(LockKey::MAX_LEN + 1),
            "a\0b".into(),
            "a\nb".into(),
            "\u{7f}".into(),
        ] {
            assert!(
                matches!(LockKey::new(&name), Err(Error::InvalidKey { .. })),
                "{name:?}"
            );
        }
    }
}
