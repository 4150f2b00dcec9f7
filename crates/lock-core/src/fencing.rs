//! The resource side of fencing: accept a write only with a token newer than any accepted.
//!
//! A lease can lapse while its holder is paused; fencing makes the *resource* reject the stale
//! holder's late write. The check and the write must be one atomic step of the resource itself
//! (here a mutex; in SQL, `UPDATE … WHERE last_fencing_token < $t`).

use std::{
    fmt,
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use crate::FencingToken;

/// A write presented a fencing token no newer than one already accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("stale fencing token {presented}: the resource has already accepted {highest}")]
pub struct StaleFencingToken {
    /// The token that came with the rejected write.
    pub presented: FencingToken,
    /// The highest token accepted so far.
    pub highest: FencingToken,
}

/// An in-memory resource guarded by fencing tokens: a value plus the highest token accepted,
/// checked and updated atomically. Counts accepted and rejected writes.
pub struct FencedRegister<T> {
    state: Mutex<(Option<FencingToken>, Option<T>)>,
    accepted: AtomicU64,
    rejected: AtomicU64,
}

impl<T> FencedRegister<T> {
    /// An empty register.
    pub fn new() -> Self {
        Self {
            state: Mutex::new((None, None)),
            accepted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    /// Stores `value` iff `token` is greater than every token accepted so far.
    ///
    /// # Errors
    /// [`StaleFencingToken`] otherwise; the value is unchanged and the rejection counted.
    pub fn write(&self, token: FencingToken, value: T) -> Result<(), StaleFencingToken> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(highest) = state.0
            && token <= highest
        {
            self.rejected.fetch_add(1, Ordering::SeqCst);
            crate::record_fencing_rejection("fenced_register");
            return Err(StaleFencingToken {
                presented: token,
                highest,
            });
        }
        *state = (Some(token), Some(value));
        self.accepted.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// The highest token accepted so far.
    pub fn highest_token(&self) -> Option<FencingToken> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0
    }

    /// Writes accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Writes rejected as stale so far.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::SeqCst)
    }
}

impl<T: Clone> FencedRegister<T> {
    /// The last accepted value.
    pub fn value(&self) -> Option<T> {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .1
            .clone()
    }
}

impl<T> Default for FencedRegister<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> fmt::Debug for FencedRegister<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FencedRegister")
            .field("highest", &self.highest_token())
            .field("accepted", &self.accepted())
            .field("rejected", &self.rejected())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_only_newer_tokens() {
        let r = FencedRegister::new();
        r.write(FencingToken(2), "a").unwrap();
        assert_eq!(
            r.write(FencingToken(1), "stale"),
            Err(StaleFencingToken {
                presented: FencingToken(1),
                highest: FencingToken(2)
            })
        );
        assert!(r.write(FencingToken(2), "same").is_err());
        r.write(FencingToken(7), "b").unwrap();
        assert_eq!(r.value(), Some("b"));
        assert_eq!((r.accepted(), r.rejected()), (2, 2));
    }
}
