//! A fault-injecting TCP proxy for drills: put it between a client and its coordinator and
//! switch faults at run time.
//!
//! Every accepted connection gets its own upstream connection and two pumps (request:
//! client→server, reply: server→client). The current [`Fault`] applies to existing and new
//! connections alike, and can be changed at any time:
//!
//! | fault | request bytes | reply bytes | sockets |
//! |---|---|---|---|
//! | [`Fault::Pass`] | forwarded | forwarded | open |
//! | [`Fault::Blackhole`] | **held** | **held** | open (no FIN, no RST) |
//! | [`Fault::Delay`] | each chunk delayed | each chunk delayed | open |
//! | [`Fault::DropReplies`] | forwarded (the request applies) | **discarded** | open; broken once healed |
//! | [`Proxy::delay_replies`] | forwarded | each chunk delayed | open |
//! | [`Proxy::delay_requests`] | each chunk delayed | forwarded | open |
//! | [`Proxy::lose_reply`]`(n)` | forwarded | replies 1..n−1 forwarded, the n-th **discarded** (once) | that connection reset at the n-th |
//! | [`Proxy::reset`] (an action) | — | — | current connections get an RST on both sides |
//!
//! **Blackhole holds, it does not drop.** A real partition drops packets, but TCP retransmits
//! them, so after the partition heals the bytes *are* delivered (unless a side gave up and
//! closed the connection first). The proxy models that: while blackholed it stops reading (bytes
//! wait in the kernel's socket buffers, and flow control stalls the sender) and holds any chunk
//! it had already read; on heal everything is delivered in order. A connection accepted while
//! blackholed is connected upstream only after the heal, so the server does not see it during
//! the partition (the client's `connect` itself succeeds at once: the kernel completes the
//! handshake with the proxy's listener).
//!
//! **Drop replies loses bytes for good**, which no healthy TCP connection ever does: a
//! connection that discarded reply bytes has a byte stream out of step with its protocol. So when
//! the fault changes away from [`Fault::DropReplies`] such a connection is reset instead of
//! resuming — exactly what a client sees when its request's reply was lost and the connection
//! died. Connections that discarded nothing continue normally.
//!
//! **Replies are counted in turns.** A *reply turn* of a connection is the server's answer to
//! what the client sent since the server last spoke: the first reply chunk read after request
//! bytes were forwarded begins a turn (a reply split over several chunks is one turn; replies to
//! pipelined requests arriving together are one turn too). Turns are counted from the moment the
//! fault was last set ([`Proxy::reply_turns`]), so that setting [`Fault::Pass`] before an
//! operation and reading the count after it tells how many round trips it took — and
//! [`Proxy::lose_reply`]`(n)` loses the first n-th turn any connection reaches since it was set:
//! requests before it reach the server, its first n−1 answers come back, the n-th is discarded
//! and the connection reset (a reply lost past the first round trip); after that one loss
//! everything passes again, so a driver that re-sends gets its answer — which is how a blind
//! re-send of a non-idempotent request shows. Unsolicited server traffic (pings,
//! watch events) counts when it follows request bytes, so counts are approximate for protocols
//! that have it; a drill that loses each turn 1..=n in turn covers every round trip anyway.

use std::{
    io,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::FutureExt;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpListener, TcpStream,
        tcp::{ReadHalf, WriteHalf},
    },
    sync::watch,
    task::JoinHandle,
};

/// What the proxy does to the traffic of every connection (see the [module docs](self)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fault {
    /// Forward both directions as they come.
    #[default]
    Pass,
    /// Forward nothing in either direction but keep the sockets open; held bytes are delivered
    /// when the fault changes (a partition that heals).
    Blackhole,
    /// Delay each chunk by this much before forwarding it (a slow link; later chunks queue
    /// behind earlier ones, order is kept).
    Delay(Duration),
    /// Forward requests, discard replies: the request applies but its reply is lost. Connections
    /// that lost bytes are reset when the fault changes.
    DropReplies,
}

/// The one-direction faults, kept apart from [`Fault`] (whose variants drills match on): set by
/// [`Proxy::delay_replies`], [`Proxy::delay_requests`] and [`Proxy::lose_reply`] with
/// [`Fault::Pass`], cleared by every [`Proxy::set`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Shape {
    #[default]
    None,
    /// Delay each reply chunk: requests apply at server speed while their answers are in
    /// flight.
    DelayReplies(Duration),
    /// Delay each request chunk: a future dropped meanwhile is dropped before its request
    /// reached the coordinator, which still gets it later.
    DelayRequests(Duration),
    /// Forward each connection's first n−1 reply turns, discard the first n-th one any
    /// connection reaches and reset that connection, then forward everything (0 and 1 both lose
    /// the first).
    LoseReply(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Request,
    Reply,
}

struct Shared {
    upstream: SocketAddr,
    fault: watch::Sender<Fault>,
    shape: std::sync::Mutex<Shape>,
    resets: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
    connections: watch::Sender<usize>,
    accepted: AtomicU64,
    /// Bumped by every [`Proxy::set`], so that reply turns are counted from then.
    generation: AtomicU64,
    /// Reply turns, over all connections, since the fault was last set.
    turns: AtomicU64,
    /// Request chunks read from clients since the start.
    request_chunks: AtomicU64,
    /// Reply turns lost by [`Proxy::lose_reply`] since the start.
    lost_turns: AtomicU64,
    /// The generation (+1) in which [`Proxy::lose_reply`] lost its turn: one loss per setting.
    lost_in: AtomicU64,
}

/// What a connection's reply pump needs to know of its request pump: the generation and
/// sequence number of the last request chunk forwarded (`generation << 32 | sequence`).
#[derive(Default)]
struct Turns {
    last_request: AtomicU64,
}

/// A TCP proxy on `127.0.0.1:<ephemeral port>` in front of one upstream address.
///
/// Dropping it stops accepting and resets every connection it carries.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy in front of `upstream`, listening on `127.0.0.1:0`, in [`Fault::Pass`].
    ///
    /// # Errors
    /// When the listener cannot be bound.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            fault: watch::Sender::new(Fault::Pass),
            shape: std::sync::Mutex::new(Shape::None),
            resets: watch::Sender::new(0),
            shutdown: watch::Sender::new(false),
            connections: watch::Sender::new(0),
            accepted: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            turns: AtomicU64::new(0),
            request_chunks: AtomicU64::new(0),
            lost_turns: AtomicU64::new(0),
            lost_in: AtomicU64::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Self {
            addr,
            shared,
            accept,
        })
    }

    /// Starts a proxy in front of the `host:port` of `url` (e.g. `redis://127.0.0.1:6390/0`) and
    /// returns it with the same URL pointed at the proxy.
    ///
    /// # Errors
    /// When the URL has no `host:port` authority, the host does not resolve, or binding fails.
    pub async fn start_for_url(url: &str) -> io::Result<(Self, String)> {
        let (_, authority, _) = split_url(url)?;
        let upstream = tokio::net::lookup_host(authority.as_str())
            .await?
            .next()
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{authority} does not resolve"),
                )
            })?;
        let proxy = Self::start(upstream).await?;
        let proxied = rewrite_url(url, proxy.addr())?;
        Ok((proxy, proxied))
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server behind the proxy.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// The current fault.
    pub fn fault(&self) -> Fault {
        *self.shared.fault.borrow()
    }

    /// Switches to `fault` for existing and new connections, and restarts the count of reply
    /// turns.
    pub fn set(&self, fault: Fault) {
        self.set_shaped(fault, Shape::None);
    }

    fn set_shaped(&self, fault: Fault, shape: Shape) {
        // The generation first, so that a pump seeing the new fault counts in the new one.
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        self.shared.turns.store(0, Ordering::SeqCst);
        *self
            .shared
            .shape
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = shape;
        self.shared.fault.send_replace(fault);
    }

    /// Delays every reply chunk by `delay`, requests pass at once (a [`Fault::Pass`] with
    /// slow answers; any [`Proxy::set`] ends it).
    pub fn delay_replies(&self, delay: Duration) {
        self.set_shaped(Fault::Pass, Shape::DelayReplies(delay));
    }

    /// Delays every request chunk by `delay`, replies pass at once (any [`Proxy::set`] ends it).
    pub fn delay_requests(&self, delay: Duration) {
        self.set_shaped(Fault::Pass, Shape::DelayRequests(delay));
    }

    /// From now on connections forward their first `n`−1 reply turns; the first to reach its
    /// `n`-th loses it and is reset, then everything passes (see the [module docs](self); any
    /// [`Proxy::set`] ends it).
    pub fn lose_reply(&self, n: u32) {
        self.set_shaped(Fault::Pass, Shape::LoseReply(n));
    }

    /// Reply turns over all connections since the fault was last set (see the
    /// [module docs](self)).
    pub fn reply_turns(&self) -> u64 {
        self.shared.turns.load(Ordering::SeqCst)
    }

    /// Reply turns [`Proxy::lose_reply`] discarded since the start (each reset its connection).
    pub fn lost_turns(&self) -> u64 {
        self.shared.lost_turns.load(Ordering::SeqCst)
    }

    /// Request chunks read from clients since the start (grows whenever a client sends).
    pub fn request_chunks(&self) -> u64 {
        self.shared.request_chunks.load(Ordering::SeqCst)
    }

    /// Heals: forward everything (held bytes are delivered now).
    pub fn pass(&self) {
        self.set(Fault::Pass);
    }

    /// Partitions: hold both directions, keep the sockets open.
    pub fn blackhole(&self) {
        self.set(Fault::Blackhole);
    }

    /// Delays every chunk by `delay`.
    pub fn delay(&self, delay: Duration) {
        self.set(Fault::Delay(delay));
    }

    /// Lets requests through and discards replies.
    pub fn drop_replies(&self) {
        self.set(Fault::DropReplies);
    }

    /// Resets (RST on both sides) every connection open now. New connections are accepted as
    /// usual afterwards.
    pub fn reset(&self) {
        self.shared.resets.send_modify(|n| *n += 1);
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        *self.shared.connections.borrow()
    }

    /// Connections accepted since the start.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Waits until the number of open connections satisfies `ready` (no polling: every open and
    /// close is signalled). Bound it with a timeout.
    pub async fn wait_connections(&self, mut ready: impl FnMut(usize) -> bool) -> usize {
        let mut rx = self.shared.connections.subscribe();
        match rx.wait_for(|n| ready(*n)).await {
            Ok(n) => *n,
            // The sender lives in `self.shared`, which outlives this borrow.
            Err(_) => self.connections(),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.shutdown.send_replace(true);
        self.accept.abort();
    }
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("fault", &self.fault())
            .field("connections", &self.connections())
            .finish()
    }
}

/// Splits `scheme://[userinfo@]host:port[/rest]` into (`scheme://[userinfo@]`, `host:port`,
/// `rest`).
fn split_url(url: &str) -> io::Result<(String, String, String)> {
    let bad = || io::Error::new(io::ErrorKind::InvalidInput, "the URL has no host:port");
    let scheme_end = url.find("://").ok_or_else(bad)? + 3;
    let rest = &url[scheme_end..];
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..auth_end];
    let host_start = authority.rfind('@').map_or(0, |i| i + 1);
    let host_port = &authority[host_start..];
    if host_port.is_empty() || !host_port.contains(':') || host_port.contains(',') {
        return Err(bad());
    }
    Ok((
        format!("{}{}", &url[..scheme_end], &authority[..host_start]),
        host_port.to_owned(),
        rest[auth_end..].to_owned(),
    ))
}

/// `url` with its `host:port` replaced by `addr` (user info, path and query kept).
///
/// # Errors
/// When the URL has no single `host:port` authority.
pub fn rewrite_url(url: &str, addr: SocketAddr) -> io::Result<String> {
    let (prefix, _, rest) = split_url(url)?;
    Ok(format!("{prefix}{addr}{rest}"))
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut shutdown = shared.shutdown.subscribe();
    loop {
        tokio::select! {
            _ = shutdown.wait_for(|stop| *stop).map(|_| ()) => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    shared.accepted.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(serve(shared.clone(), stream));
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    }
}

/// Counts a connection as open for as long as it lives.
struct OpenConnection(Arc<Shared>);

impl OpenConnection {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.connections.send_modify(|n| *n += 1);
        Self(shared.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.connections.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Completes when the proxy resets current connections or shuts down.
struct Ending {
    resets: watch::Receiver<u64>,
    shutdown: watch::Receiver<bool>,
}

impl Ending {
    async fn wait(&mut self) {
        tokio::select! {
            _ = self.resets.changed() => {}
            _ = self.shutdown.wait_for(|stop| *stop).map(|_| ()) => {}
        }
    }
}

async fn serve(shared: Arc<Shared>, mut client: TcpStream) {
    let _open = OpenConnection::new(&shared);
    let mut ending = Ending {
        resets: shared.resets.subscribe(),
        shutdown: shared.shutdown.subscribe(),
    };
    let fault = shared.fault.subscribe();
    let connect = async {
        // A partitioned client's handshake would not reach the server: connect after the heal.
        let mut fault = fault.clone();
        fault
            .wait_for(|f| *f != Fault::Blackhole)
            .await
            .map_err(|_| broken("proxy stopped"))?;
        TcpStream::connect(shared.upstream).await
    };
    let mut server = tokio::select! {
        biased;
        () = ending.wait() => {
            let _ = client.set_zero_linger();
            return;
        }
        server = connect => match server {
            Ok(server) => server,
            Err(_) => {
                // Upstream refused: the client sees its connection reset, as it would directly.
                let _ = client.set_zero_linger();
                return;
            }
        },
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let reset = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let turns = Turns::default();
        let pumps = futures::future::try_join(
            pump(
                client_read,
                server_write,
                Direction::Request,
                fault.clone(),
                (&shared, &turns),
            ),
            pump(
                server_read,
                client_write,
                Direction::Reply,
                fault,
                (&shared, &turns),
            ),
        );
        tokio::select! {
            biased;
            () = ending.wait() => true,
            done = pumps => done.is_err(),
        }
    };
    if reset {
        let _ = client.set_zero_linger();
        let _ = server.set_zero_linger();
    }
}

fn broken(why: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, why)
}

/// Counts reply turns for one connection's reply pump.
struct TurnCounter {
    generation: u64,
    turns: u32,
    last_request: u64,
}

impl TurnCounter {
    /// Whether a reply chunk read now begins a new turn, and that turn's number since the
    /// fault was set.
    fn on_reply(&mut self, shared: &Shared, conn: &Turns) -> Option<u32> {
        let generation = shared.generation.load(Ordering::SeqCst);
        if generation != self.generation {
            self.generation = generation;
            self.turns = 0;
        }
        let last = conn.last_request.load(Ordering::SeqCst);
        if last == self.last_request {
            return None;
        }
        self.last_request = last;
        // A request sent before the fault was set answers a turn that is not counted.
        if last >> 32 != generation & 0xffff_ffff {
            return None;
        }
        self.turns = self.turns.saturating_add(1);
        shared.turns.fetch_add(1, Ordering::SeqCst);
        Some(self.turns)
    }
}

/// Copies one direction until EOF (then half-closes the other side) or an error, applying the
/// current fault to every chunk.
async fn pump(
    mut from: ReadHalf<'_>,
    mut to: WriteHalf<'_>,
    direction: Direction,
    mut fault: watch::Receiver<Fault>,
    (shared, conn): (&Shared, &Turns),
) -> io::Result<()> {
    let stopped = |_| broken("proxy stopped");
    let lost_bytes = || broken("reply bytes were dropped on this connection");
    let mut buf = vec![0u8; 16 * 1024];
    // Set once this direction discarded bytes: the stream can no longer be healed.
    let mut tainted = false;
    let mut counter = TurnCounter {
        generation: shared.generation.load(Ordering::SeqCst),
        turns: 0,
        last_request: 0,
    };
    let mut sequence: u64 = 0;
    loop {
        // Blackholed: do not even read, so the bytes wait in the kernel (and stall the sender).
        let current = *fault
            .wait_for(|f| *f != Fault::Blackhole)
            .await
            .map_err(stopped)?;
        if tainted && current != Fault::DropReplies {
            return Err(lost_bytes());
        }
        let n = loop {
            tokio::select! {
                read = from.read(&mut buf) => break read?,
                changed = fault.changed(), if tainted => {
                    changed.map_err(stopped)?;
                    if *fault.borrow_and_update() != Fault::DropReplies {
                        return Err(lost_bytes());
                    }
                }
            }
        };
        // A chunk read just before a blackhole began is held too.
        let current = *fault
            .wait_for(|f| *f != Fault::Blackhole)
            .await
            .map_err(stopped)?;
        if n == 0 {
            to.shutdown().await?;
            return Ok(());
        }
        let turn = match direction {
            Direction::Request => {
                shared.request_chunks.fetch_add(1, Ordering::SeqCst);
                None
            }
            Direction::Reply => counter.on_reply(shared, conn),
        };
        match current {
            Fault::Pass | Fault::Blackhole => {}
            Fault::Delay(delay) => tokio::time::sleep(delay).await,
            Fault::DropReplies if direction == Direction::Reply => {
                tainted = true;
                continue;
            }
            Fault::DropReplies => {}
        }
        let shape = *shared
            .shape
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match shape {
            Shape::DelayReplies(delay) if direction == Direction::Reply => {
                tokio::time::sleep(delay).await;
            }
            Shape::DelayRequests(delay) if direction == Direction::Request => {
                tokio::time::sleep(delay).await;
            }
            Shape::LoseReply(n)
                if turn.is_some_and(|t| t >= n)
                    && shared.lost_in.swap(
                        shared.generation.load(Ordering::SeqCst) + 1,
                        Ordering::SeqCst,
                    ) != shared.generation.load(Ordering::SeqCst) + 1 =>
            {
                shared.lost_turns.fetch_add(1, Ordering::SeqCst);
                return Err(broken("the n-th reply was lost"));
            }
            Shape::None
            | Shape::DelayReplies(_)
            | Shape::DelayRequests(_)
            | Shape::LoseReply(_) => {}
        }
        to.write_all(&buf[..n]).await?;
        if direction == Direction::Request {
            // Recorded once forwarded: the reply that follows answers it.
            sequence = (sequence + 1) & 0xffff_ffff;
            let generation = shared.generation.load(Ordering::SeqCst) & 0xffff_ffff;
            conn.last_request
                .store(generation << 32 | sequence, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback: every chunk read is written back.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    /// One request, its echo: `None` when the connection broke instead.
    async fn round_trip(s: &mut TcpStream, msg: &[u8]) -> Option<Vec<u8>> {
        s.write_all(msg).await.ok()?;
        let mut buf = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut buf))
            .await
            .ok()?
            .ok()?;
        Some(buf)
    }

    #[tokio::test]
    async fn lose_reply_loses_the_nth_turn_once_and_counts_turns() {
        let proxy = Proxy::start(echo().await).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.pass();
        assert_eq!(round_trip(&mut c, b"a").await.as_deref(), Some(&b"a"[..]));
        assert_eq!(round_trip(&mut c, b"b").await.as_deref(), Some(&b"b"[..]));
        assert_eq!(proxy.reply_turns(), 2);
        proxy.lose_reply(2);
        assert_eq!(round_trip(&mut c, b"c").await.as_deref(), Some(&b"c"[..]));
        assert_eq!(
            round_trip(&mut c, b"d").await,
            None,
            "the second turn is lost"
        );
        assert_eq!(proxy.lost_turns(), 1);
        // Lost once: a new connection's second turn passes.
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut c, b"e").await.as_deref(), Some(&b"e"[..]));
        assert_eq!(round_trip(&mut c, b"f").await.as_deref(), Some(&b"f"[..]));
        assert_eq!(proxy.lost_turns(), 1);
    }

    #[test]
    fn urls_are_rewritten_to_the_proxy() {
        let addr: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(
            rewrite_url("redis://127.0.0.1:6390/0", addr).unwrap(),
            "redis://127.0.0.1:4000/0"
        );
        assert_eq!(
            rewrite_url("postgres://u:p@localhost:5432/db?sslmode=disable", addr).unwrap(),
            "postgres://u:p@127.0.0.1:4000/db?sslmode=disable"
        );
        assert_eq!(
            rewrite_url("etcd://127.0.0.1:2379", addr).unwrap(),
            "etcd://127.0.0.1:4000"
        );
        assert!(rewrite_url("memory://", addr).is_err());
        assert!(rewrite_url("zk://a:1,b:2/root", addr).is_err());
    }
}
