//! Ownership and fencing tokens.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// 128 random bits that identify one acquisition.
///
/// A fresh token is drawn for every acquisition, so a stale holder can never renew or release a
/// later holder's lease. The full value is a secret: `Debug` and `Display` show only a short
/// [`TokenDigest`]; use [`OwnershipToken::expose_hex`] to put it on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnershipToken([u8; 16]);

impl OwnershipToken {
    /// Draws a new token from the operating system's CSPRNG-seeded generator.
    pub fn generate() -> Self {
        Self(rand::random())
    }

    /// Wraps raw bytes (e.g. read back from a coordinator).
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// Parses the 32-character lowercase hex form written by [`OwnershipToken::expose_hex`].
    ///
    /// # Errors
    /// [`Error::Config`] when `s` is not 32 hex digits.
    pub fn from_hex(s: &str) -> Result<Self> {
        let bytes = s.as_bytes();
        if bytes.len() != 32 {
            return Err(Error::Config("an ownership token is 32 hex digits".into()));
        }
        let mut out = [0u8; 16];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let hi = hex_value(pair[0]);
            let lo = hex_value(pair[1]);
            match (hi, lo) {
                (Some(hi), Some(lo)) => out[i] = hi << 4 | lo,
                _ => return Err(Error::Config("an ownership token is 32 hex digits".into())),
            }
        }
        Ok(Self(out))
    }

    /// The raw bytes. Treat as a secret.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// The full token as 32 lowercase hex digits, for storing in the coordinator.
    /// Treat as a secret: never log it.
    pub fn expose_hex(&self) -> String {
        self.expose_hex_bytes()
            .iter()
            .copied()
            .map(char::from)
            .collect()
    }

    /// [`OwnershipToken::expose_hex`] without an allocation: the 32 lowercase hex digits as
    /// ASCII bytes (a driver writing many tokens straight into a request). Treat as a secret.
    pub fn expose_hex_bytes(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (pair, b) in out.chunks_exact_mut(2).zip(self.0) {
            pair[0] = HEX[usize::from(b >> 4)];
            pair[1] = HEX[usize::from(b & 0xf)];
        }
        out
    }

    /// A short, non-reversible digest that is safe to log and display.
    pub fn digest(&self) -> TokenDigest {
        TokenDigest::of(&self.0)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl fmt::Debug for OwnershipToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnershipToken({})", self.digest())
    }
}

impl fmt::Display for OwnershipToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.digest(), f)
    }
}

/// The first 32 bits of SHA-256 of a token, as 8 hex digits: identifies a holder in logs,
/// `inspect` output and runbooks without revealing the token.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenDigest([u8; 4]);

impl TokenDigest {
    /// The digest of an arbitrary stored owner value (for drivers that read back the raw bytes).
    pub fn of(bytes: &[u8]) -> Self {
        let hash = Sha256::digest(bytes);
        Self([hash[0], hash[1], hash[2], hash[3]])
    }
}

impl fmt::Display for TokenDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenDigest({self})")
    }
}

/// A number minted by the coordinator in the same atomic step as a grant, strictly increasing per
/// key across every grant. The protected resource accepts a write only with a token at least as
/// new as any it has seen (see [`crate::fencing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_and_round_trip_through_hex() {
        let a = OwnershipToken::generate();
        let b = OwnershipToken::generate();
        assert_ne!(a, b);
        assert_eq!(OwnershipToken::from_hex(&a.expose_hex()).unwrap(), a);
        let bytes = *a.as_bytes();
        assert_ne!(bytes, [0; 16], "a fresh token is random");
        assert_eq!(OwnershipToken::from_bytes(bytes), a);
        // Every digit's value, in both cases (the stored form is lowercase; an operator may
        // paste uppercase).
        assert_eq!(
            OwnershipToken::from_hex("0123456789abcdefABCDEF0123456789")
                .unwrap()
                .as_bytes(),
            &[
                0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45,
                0x67, 0x89
            ]
        );
        assert!(OwnershipToken::from_hex("xyz").is_err());
        assert!(OwnershipToken::from_hex(&"g".repeat(32)).is_err());
    }

    #[test]
    fn a_fencing_token_is_its_number() {
        let t = FencingToken(u64::MAX - 1);
        assert_eq!(t.get(), u64::MAX - 1);
        assert_eq!(t.to_string(), "18446744073709551614");
        assert_eq!(FencingToken(7).get(), 7);
    }

    #[test]
    fn debug_and_display_never_show_the_token() {
        let t = OwnershipToken::generate();
        let full = t.expose_hex();
        // What they show instead: the digest's 8 hex digits.
        assert_eq!(format!("{t:?}"), format!("OwnershipToken({})", t.digest()));
        assert_eq!(format!("{t}").len(), 8);
        assert_eq!(format!("{:?}", t.digest()), format!("TokenDigest({t})"));
        for shown in [
            format!("{t:?}"),
            format!("{t}"),
            format!("{:?}", t.digest()),
        ] {
            assert!(!shown.contains(&full), "{shown}");
            assert!(
                !shown.contains(&full[..8]),
                "{shown} shows a prefix of the token"
            );
        }
        assert_eq!(t.digest().to_string().len(), 8);
    }
}
