//! Natural batching for drivers: requests that arrive while a batch is in flight go out
//! together in the next one.
//!
//! A driver that can renew many leases in one round trip (a multi-key script, one `UPDATE …
//! FROM unnest(…)`, one session check) puts its renewals through a [`Batcher`]. A lone request
//! is sent at once, alone, with no added delay; requests that arrive while it is in flight are
//! queued and sent together as soon as it returns. Combined with the watchdog's aligned
//! renewal times (every guard of a process renews on the same grid), a tick of any number of
//! held locks costs a handful of round trips instead of one per lock.
//!
//! Each batch runs in its own task, so a caller that gives up (its future is dropped) never
//! strands the others.

use std::{
    collections::VecDeque,
    future::Future,
    sync::{Arc, Mutex, PoisonError},
};

use tokio::sync::oneshot;

/// Collects items submitted concurrently and hands them to a batch function, one batch in
/// flight at a time.
pub struct Batcher<T, R> {
    state: Arc<Mutex<State<T, R>>>,
    max_batch: usize,
}

struct State<T, R> {
    queue: VecDeque<(T, oneshot::Sender<R>)>,
    running: bool,
}

impl<T, R> std::fmt::Debug for Batcher<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Batcher")
            .field("queued", &state.queue.len())
            .field("running", &state.running)
            .field("max_batch", &self.max_batch)
            .finish()
    }
}

impl<T: Send + 'static, R: Send + 'static> Batcher<T, R> {
    /// A batcher that hands at most `max_batch` items (at least 1) to one call of the batch
    /// function.
    pub fn new(max_batch: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                queue: VecDeque::new(),
                running: false,
            })),
            max_batch: max_batch.max(1),
        }
    }

    /// Submits `item` and waits for its answer.
    ///
    /// `run` receives a batch (this item and whatever else is queued, in submission order)
    /// and must return one answer per item, in the same order. When no batch is in flight,
    /// a task is spawned that runs batches with this `run` until the queue is empty; `run`
    /// should therefore capture only what it needs (the task ends when idle, so capturing an
    /// `Arc` of the driver creates no lasting cycle).
    ///
    /// Returns `None` when no answer came back: `run` returned fewer answers than items, or
    /// its task panicked or was cancelled (runtime shutdown). Must be called within a tokio
    /// runtime.
    pub async fn submit<F, Fut>(&self, item: T, run: F) -> Option<R>
    where
        F: Fn(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<R>> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.queue.push_back((item, tx));
            !std::mem::replace(&mut state.running, true)
        };
        if start {
            tokio::spawn(drain(self.state.clone(), self.max_batch, run));
        }
        rx.await.ok()
    }
}

/// Runs batches until the queue is empty, then marks the batcher idle (under the same lock a
/// submitter checks, so no item is ever left without a running task).
async fn drain<T, R, F, Fut>(state: Arc<Mutex<State<T, R>>>, max_batch: usize, run: F)
where
    F: Fn(Vec<T>) -> Fut,
    Fut: Future<Output = Vec<R>>,
{
    // Should this task die (panic, runtime shutdown), the batcher must not stay "running"
    // forever with nobody draining it: the reset guard hands the queue back (dropping the
    // senders, so the waiting callers get `None`) and marks it idle.
    let mut reset = ResetOnDrop {
        state: state.clone(),
        armed: true,
    };
    loop {
        let (items, senders): (Vec<T>, Vec<oneshot::Sender<R>>) = {
            let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
            if state.queue.is_empty() {
                state.running = false;
                reset.armed = false;
                return;
            }
            let n = state.queue.len().min(max_batch);
            state.queue.drain(..n).unzip()
        };
        let answers = run(items).await;
        for (sender, answer) in senders.into_iter().zip(answers) {
            // The caller may have given up; its answer is then dropped.
            let _ = sender.send(answer);
        }
    }
}

struct ResetOnDrop<T, R> {
    state: Arc<Mutex<State<T, R>>>,
    armed: bool,
}

impl<T, R> Drop for ResetOnDrop<T, R> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.queue.clear();
        state.running = false;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    impl<T, R> Batcher<T, R> {
        fn queued(&self) -> usize {
            self.state
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .queue
                .len()
        }
    }

    /// Yields until `cond` holds; fails after 10 s instead of hanging.
    async fn until(cond: impl Fn() -> bool) {
        tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while !cond() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the condition never held");
    }

    #[tokio::test]
    async fn a_lone_item_goes_alone_and_concurrent_ones_share_a_batch() {
        let batcher = Arc::new(Batcher::<u32, u32>::new(100));
        let calls = Arc::new(Mutex::new(Vec::<usize>::new()));
        let (gate_tx, gate_rx) = tokio::sync::watch::channel(false);
        let run = {
            let calls = calls.clone();
            move |items: Vec<u32>| {
                let calls = calls.clone();
                let mut gate = gate_rx.clone();
                async move {
                    calls.lock().unwrap().push(items.len());
                    // The first batch is held until the others have queued behind it.
                    let _ = gate.wait_for(|open| *open).await;
                    items.into_iter().map(|i| i * 10).collect()
                }
            }
        };
        let first = {
            let (b, run) = (batcher.clone(), run.clone());
            tokio::spawn(async move { b.submit(1, run).await })
        };
        until(|| !calls.lock().unwrap().is_empty()).await;
        let rest: Vec<_> = (2..=20)
            .map(|i| {
                let (b, run) = (batcher.clone(), run.clone());
                tokio::spawn(async move { b.submit(i, run).await })
            })
            .collect();
        until(|| batcher.queued() == 19).await;
        // What `Debug` shows of a batcher with one batch out and 19 behind it.
        assert_eq!(
            format!("{batcher:?}"),
            "Batcher { queued: 19, running: true, max_batch: 100 }"
        );
        gate_tx.send(true).unwrap();
        assert_eq!(first.await.unwrap(), Some(10));
        for (i, handle) in (2..=20).zip(rest) {
            assert_eq!(handle.await.unwrap(), Some(i * 10));
        }
        assert_eq!(*calls.lock().unwrap(), vec![1, 19]);
    }

    #[test]
    fn an_idle_batcher_takes_at_least_one_item_per_batch() {
        assert_eq!(
            format!("{:?}", Batcher::<u32, u32>::new(0)),
            "Batcher { queued: 0, running: false, max_batch: 1 }"
        );
    }

    #[tokio::test]
    async fn batches_are_capped_and_short_answers_are_none() {
        let batcher = Arc::new(Batcher::<u32, u32>::new(3));
        let calls = Arc::new(AtomicUsize::new(0));
        let run = {
            let calls = calls.clone();
            move |items: Vec<u32>| {
                calls.fetch_add(1, Ordering::SeqCst);
                // Answers only the first item of each batch.
                async move { items.into_iter().take(1).collect() }
            }
        };
        let handles: Vec<_> = (0..7)
            .map(|i| {
                let (b, run) = (batcher.clone(), run.clone());
                tokio::spawn(async move { b.submit(i, run).await })
            })
            .collect();
        let mut answered = 0;
        for handle in handles {
            if handle.await.unwrap().is_some() {
                answered += 1;
            }
        }
        let calls = calls.load(Ordering::SeqCst);
        assert!(calls >= 3, "7 items in batches of at most 3: {calls} calls");
        assert_eq!(answered, calls);
    }

    #[tokio::test]
    async fn a_panicking_batch_answers_none_and_the_batcher_recovers() {
        let batcher = Batcher::<u32, u32>::new(10);
        let answer = batcher
            .submit(1, |_items: Vec<u32>| async move {
                panic!("batch failed");
                #[allow(unreachable_code)]
                Vec::new()
            })
            .await;
        assert_eq!(answer, None);
        let answer = batcher
            .submit(2, |items: Vec<u32>| async move { items })
            .await;
        assert_eq!(answer, Some(2));
    }
}
