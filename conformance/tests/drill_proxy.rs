//! The fault-injecting proxy against a plain TCP server: each fault does what its docs say.
//!
//! "Nothing arrives" is asserted over a bounded quiet window ([`QUIET`]); everything that must
//! happen is awaited as an event with a generous bound ([`SOON`]).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{io, net::SocketAddr, time::Duration};

use conformance::drill::{Fault, Proxy};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::mpsc,
    time::{Instant, timeout},
};

/// How long "nothing arrives" is watched.
const QUIET: Duration = Duration::from_millis(300);
/// The bound on anything that must happen (a loaded 2-core machine).
const SOON: Duration = Duration::from_secs(5);

/// One server-side connection: what it received, and a way to send on it.
struct ServerConn {
    received: mpsc::UnboundedReceiver<Vec<u8>>,
    send: mpsc::UnboundedSender<Vec<u8>>,
}

/// A TCP server on loopback that reports every connection; with `echo` it writes back whatever
/// it reads (and still reports it).
struct Upstream {
    addr: SocketAddr,
    accepted: mpsc::UnboundedReceiver<ServerConn>,
}

impl Upstream {
    async fn start(echo: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, accepted) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (received_tx, received) = mpsc::unbounded_channel();
                let (send, mut send_rx) = mpsc::unbounded_channel::<Vec<u8>>();
                let (mut read, mut write) = stream.into_split();
                let echo_tx = send.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    while let Ok(n) = read.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        let _ = received_tx.send(buf[..n].to_vec());
                        if echo {
                            let _ = echo_tx.send(buf[..n].to_vec());
                        }
                    }
                    // Dropping received_tx tells the test the connection ended.
                });
                tokio::spawn(async move {
                    while let Some(bytes) = send_rx.recv().await {
                        if write.write_all(&bytes).await.is_err() {
                            break;
                        }
                    }
                });
                if tx.send(ServerConn { received, send }).is_err() {
                    break;
                }
            }
        });
        Self { addr, accepted }
    }

    async fn next_conn(&mut self) -> ServerConn {
        timeout(SOON, self.accepted.recv())
            .await
            .expect("the upstream should accept a connection")
            .expect("upstream stopped")
    }
}

/// Reads whatever arrives within `within`: `None` if nothing did.
async fn read_within(stream: &mut TcpStream, within: Duration) -> Option<io::Result<Vec<u8>>> {
    let mut buf = vec![0u8; 4096];
    match timeout(within, stream.read(&mut buf)).await {
        Err(_) => None,
        Ok(Ok(n)) => Some(Ok(buf[..n].to_vec())),
        Ok(Err(e)) => Some(Err(e)),
    }
}

/// Reads exactly `n` bytes within [`SOON`].
async fn read_exact_soon(stream: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    timeout(SOON, stream.read_exact(&mut buf))
        .await
        .expect("bytes should arrive")
        .expect("read failed");
    buf
}

async fn received_soon(conn: &mut ServerConn) -> Option<Vec<u8>> {
    timeout(SOON, conn.received.recv())
        .await
        .expect("the server should see bytes or the end of the connection")
}

async fn connect(proxy: &Proxy) -> TcpStream {
    let stream = TcpStream::connect(proxy.addr()).await.unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn round_trips(stream: &mut TcpStream, n: usize) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    let msg = [7u8; 16];
    for _ in 0..n {
        let t = Instant::now();
        stream.write_all(&msg).await.unwrap();
        let _ = read_exact_soon(stream, msg.len()).await;
        out.push(t.elapsed());
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_forwards_both_ways_and_its_overhead_is_small() {
    let mut upstream = Upstream::start(true).await;
    let proxy = Proxy::start(upstream.addr).await.unwrap();
    assert_eq!(proxy.fault(), Fault::Pass);

    let mut direct = TcpStream::connect(upstream.addr).await.unwrap();
    direct.set_nodelay(true).unwrap();
    let _direct_conn = upstream.next_conn().await;
    let mut proxied = connect(&proxy).await;
    let _proxied_conn = upstream.next_conn().await;
    assert_eq!(proxy.wait_connections(|n| n == 1).await, 1);

    // Warm up, then interleave batches so both paths see the same machine load.
    round_trips(&mut direct, 200).await;
    round_trips(&mut proxied, 200).await;
    let (mut d, mut p) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        d.extend(round_trips(&mut direct, 200).await);
        p.extend(round_trips(&mut proxied, 200).await);
    }
    d.sort();
    p.sort();
    let (dm, pm) = (percentile(&d, 0.5), percentile(&p, 0.5));
    eprintln!(
        "16-byte echo round trip over {} samples: direct median {:?} p99 {:?}; via proxy median {:?} p99 {:?}; proxy adds {:?} at the median",
        d.len(),
        dm,
        percentile(&d, 0.99),
        pm,
        percentile(&p, 0.99),
        pm.saturating_sub(dm)
    );
    assert!(
        pm < Duration::from_millis(20),
        "the proxy is far too slow: {pm:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_holds_both_directions_with_sockets_open_and_delivers_on_heal() {
    let mut upstream = Upstream::start(false).await;
    let proxy = Proxy::start(upstream.addr).await.unwrap();
    let mut client = connect(&proxy).await;
    let mut server = upstream.next_conn().await;

    proxy.blackhole();
    client.write_all(b"ping").await.unwrap();
    server.send.send(b"pong".to_vec()).unwrap();
    assert!(
        timeout(QUIET, server.received.recv()).await.is_err(),
        "the request crossed a blackhole"
    );
    assert!(
        read_within(&mut client, QUIET).await.is_none(),
        "the reply crossed a blackhole, or the socket was closed"
    );
    assert_eq!(proxy.connections(), 1, "a blackhole keeps sockets open");

    // A connection opened during the partition does not reach the server until the heal.
    let mut late_client = connect(&proxy).await;
    late_client.write_all(b"late").await.unwrap();
    assert!(
        timeout(QUIET, upstream.accepted.recv()).await.is_err(),
        "the server saw a connection through a blackhole"
    );

    proxy.pass();
    assert_eq!(
        received_soon(&mut server).await.as_deref(),
        Some(&b"ping"[..])
    );
    assert_eq!(read_exact_soon(&mut client, 4).await, b"pong");
    let mut late_server = upstream.next_conn().await;
    assert_eq!(
        received_soon(&mut late_server).await.as_deref(),
        Some(&b"late"[..])
    );
    assert_eq!(proxy.connections(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_delays_each_direction() {
    let mut upstream = Upstream::start(true).await;
    let proxy = Proxy::start(upstream.addr).await.unwrap();
    let mut client = connect(&proxy).await;
    let _server = upstream.next_conn().await;

    let delay = Duration::from_millis(150);
    proxy.delay(delay);
    let t = Instant::now();
    client.write_all(b"slow").await.unwrap();
    assert_eq!(read_exact_soon(&mut client, 4).await, b"slow");
    let rtt = t.elapsed();
    assert!(
        rtt >= 2 * delay,
        "request and reply are each delayed: {rtt:?}"
    );

    proxy.pass();
    let t = Instant::now();
    client.write_all(b"fast").await.unwrap();
    assert_eq!(read_exact_soon(&mut client, 4).await, b"fast");
    assert!(
        t.elapsed() < rtt,
        "after the heal the round trip is fast again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_replies_applies_the_request_loses_the_reply_and_breaks_only_that_connection() {
    let mut upstream = Upstream::start(true).await;
    let proxy = Proxy::start(upstream.addr).await.unwrap();
    let mut victim = connect(&proxy).await;
    let mut victim_server = upstream.next_conn().await;
    let mut idle = connect(&proxy).await;
    let _idle_server = upstream.next_conn().await;

    proxy.drop_replies();
    victim.write_all(b"req").await.unwrap();
    assert_eq!(
        received_soon(&mut victim_server).await.as_deref(),
        Some(&b"req"[..]),
        "the request must reach the server (it applies)"
    );
    assert!(
        read_within(&mut victim, QUIET).await.is_none(),
        "the reply must be lost"
    );

    proxy.pass();
    // The victim's stream lost bytes: it is reset rather than resumed out of step.
    match read_within(&mut victim, SOON).await {
        Some(Ok(bytes)) => assert!(bytes.is_empty(), "no stale reply may arrive: {bytes:?}"),
        Some(Err(e)) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset),
        None => panic!("the broken connection was not closed"),
    }
    assert_eq!(
        received_soon(&mut victim_server).await,
        None,
        "the server side of the broken connection is closed too"
    );
    // A connection that lost nothing continues.
    idle.write_all(b"still here").await.unwrap();
    assert_eq!(read_exact_soon(&mut idle, 10).await, b"still here");
    assert_eq!(proxy.wait_connections(|n| n == 1).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_closes_every_current_connection_on_both_sides() {
    let mut upstream = Upstream::start(true).await;
    let proxy = Proxy::start(upstream.addr).await.unwrap();
    let mut clients = Vec::new();
    let mut servers = Vec::new();
    for _ in 0..2 {
        clients.push(connect(&proxy).await);
        servers.push(upstream.next_conn().await);
    }
    assert_eq!(proxy.wait_connections(|n| n == 2).await, 2);

    proxy.reset();
    for client in &mut clients {
        match read_within(client, SOON).await {
            Some(Err(e)) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset),
            Some(Ok(bytes)) => assert!(bytes.is_empty(), "unexpected bytes {bytes:?}"),
            None => panic!("the connection was not reset"),
        }
    }
    for server in &mut servers {
        assert_eq!(received_soon(server).await, None);
    }
    assert_eq!(
        timeout(SOON, proxy.wait_connections(|n| n == 0))
            .await
            .unwrap(),
        0
    );

    // New connections work as before.
    let mut client = connect(&proxy).await;
    let _server = upstream.next_conn().await;
    client.write_all(b"again").await.unwrap();
    assert_eq!(read_exact_soon(&mut client, 5).await, b"again");
    assert_eq!(proxy.connections(), 1);
    assert_eq!(proxy.accepted(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_for_url_points_the_url_at_the_proxy() {
    let mut upstream = Upstream::start(true).await;
    let url = format!("redis://user:secret@{}/0?x=1", upstream.addr);
    let (proxy, proxied) = Proxy::start_for_url(&url).await.unwrap();
    assert_eq!(
        proxied,
        format!("redis://user:secret@{}/0?x=1", proxy.addr())
    );
    assert_eq!(proxy.upstream(), upstream.addr);
    let mut client = connect(&proxy).await;
    let _server = upstream.next_conn().await;
    client.write_all(b"hi").await.unwrap();
    assert_eq!(read_exact_soon(&mut client, 2).await, b"hi");
}
