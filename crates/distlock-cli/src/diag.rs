//! distlock's diagnostics on stderr, written by a thread of their own so that no supervisor
//! ever blocks on them.
//!
//! stderr may be a pipe nobody reads (a job's log collector that stalled) or a terminal whose
//! output is suspended (Ctrl-S): a plain `write` then blocks until it is drained, and a
//! supervisor or guard blocked there neither renews, nor signals the command's group, nor
//! exits. So [`line`] only queues the text; the writer thread blocks instead, and when the
//! queue is full, messages are dropped (and counted: the next one written says how many). At
//! exit, [`flush`] waits for the queue to drain, but not for a writer stuck in one write: a
//! message that cannot be written is lost, never waited for. stderr's file description is
//! shared with the command, so it is not made non-blocking.

use std::{
    io::Write,
    sync::{
        Condvar, Mutex, OnceLock, PoisonError,
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc::{Receiver, SyncSender, TrySendError, sync_channel},
    },
    time::{Duration, Instant},
};

/// Messages queued at most; more are dropped while the writer is stuck.
const CAPACITY: usize = 256;

/// A write blocked this long means stderr is not being read: [`flush`] stops waiting.
const STALLED: Duration = Duration::from_millis(200);

struct Writer {
    queue: SyncSender<Vec<u8>>,
    /// Queued and not yet written.
    pending: AtomicUsize,
    /// Dropped because the queue was full, not yet reported.
    dropped: AtomicU64,
    /// When the current write began (ms after `epoch`, + 1), or 0 while idle.
    writing_since: AtomicU64,
    epoch: Instant,
    /// Notified by the writer after each write, for [`flush`] to wait on.
    written: (Mutex<()>, Condvar),
}

static WRITER: OnceLock<Option<Writer>> = OnceLock::new();

fn writer() -> Option<&'static Writer> {
    WRITER
        .get_or_init(|| {
            let (queue, rx) = sync_channel(CAPACITY);
            let spawned = std::thread::Builder::new()
                .name("distlock-stderr".to_owned())
                .spawn(move || drain(rx));
            spawned.ok().map(|_| Writer {
                queue,
                pending: AtomicUsize::new(0),
                dropped: AtomicU64::new(0),
                writing_since: AtomicU64::new(0),
                epoch: Instant::now(),
                written: (Mutex::new(()), Condvar::new()),
            })
        })
        .as_ref()
}

fn drain(rx: Receiver<Vec<u8>>) {
    while let Ok(mut text) = rx.recv() {
        let Some(w) = WRITER.get().and_then(Option::as_ref) else {
            continue;
        };
        let dropped = w.dropped.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            let note =
                format!("distlock: {dropped} message(s) dropped: stderr was not being read\n");
            text.splice(0..0, note.into_bytes());
        }
        let since = u64::try_from(w.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        w.writing_since.store(since + 1, Ordering::Relaxed);
        let mut stderr = std::io::stderr().lock();
        let _ = stderr.write_all(&text);
        let _ = stderr.flush();
        drop(stderr);
        w.writing_since.store(0, Ordering::Relaxed);
        w.pending.fetch_sub(1, Ordering::Release);
        let _seen = w.written.0.lock().unwrap_or_else(PoisonError::into_inner);
        w.written.1.notify_all();
    }
}

/// Queues `text` for stderr as it is (no newline added); never blocks. Without a writer
/// thread (it could not be started) nothing is written: a blocking write is what this avoids.
pub fn write(text: String) {
    let Some(w) = writer() else {
        return;
    };
    w.pending.fetch_add(1, Ordering::Acquire);
    match w.queue.try_send(text.into_bytes()) {
        Ok(()) => {}
        Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
            w.pending.fetch_sub(1, Ordering::Release);
            w.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Queues one line for stderr; never blocks.
pub fn line(mut text: String) {
    text.push('\n');
    write(text);
}

/// Waits until what was queued is written, for at most `limit`, and not at all while the
/// writer is stuck in one write for longer than [`STALLED`] (stderr is not being read).
pub fn flush(limit: Duration) {
    let Some(w) = WRITER.get().and_then(Option::as_ref) else {
        return;
    };
    let started = Instant::now();
    let (lock, written) = &w.written;
    // Checked under the lock the writer notifies under: no write's notice is missed.
    let mut seen = lock.lock().unwrap_or_else(PoisonError::into_inner);
    while w.pending.load(Ordering::Acquire) > 0 && started.elapsed() < limit {
        let since = w.writing_since.load(Ordering::Relaxed);
        if since > 0 {
            let began = w.epoch + Duration::from_millis(since - 1);
            if began.elapsed() > STALLED {
                return;
            }
        }
        // Woken by the next write; at least every half STALLED to look at a stuck one.
        let wait = limit.saturating_sub(started.elapsed()).min(STALLED / 2);
        seen = written
            .wait_timeout(seen, wait)
            .map_or_else(|e| e.into_inner().0, |(g, _)| g);
    }
}

/// How long `main` waits for the diagnostics at exit.
pub const AT_EXIT: Duration = Duration::from_secs(2);
