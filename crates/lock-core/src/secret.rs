//! A credential in a driver's configuration, kept out of `Debug` output by its type.

use std::fmt;

/// A password (or another credential) in a driver's configuration.
///
/// It clones and compares like the string it holds, but `Debug` shows only `<redacted>`, so a
/// configuration can derive `Debug` and still never print a secret, and a field added later
/// cannot leak one by being forgotten in a hand-written `Debug`. There is no `Display`: the
/// value reaches the wire only through [`Secret::expose`].
///
/// ```
/// use lock_core::Secret;
///
/// let password = Secret::from("hunter2");
/// assert_eq!(format!("{password:?}"), "<redacted>");
/// assert_eq!(password.expose(), "hunter2");
/// ```
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secret(String);

impl Secret {
    /// Wraps a credential.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The credential itself, for the connection that sends it. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_value_even_nested() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?}"), "<redacted>");
        // Only `expose` gives the value, whichever way the secret was made.
        assert_eq!(s.expose(), "hunter2");
        assert_eq!(Secret::from("hunter2"), s);
        assert_eq!(Secret::from("hunter2".to_owned()), s);
        assert!(!format!("{:#?}", Some(("user", s.clone()))).contains("hunter2"));
        assert_eq!(s, Secret::from("hunter2".to_owned()));
        assert_ne!(s, Secret::default());
    }
}
