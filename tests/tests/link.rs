//! The link emulator the link benchmark uses: it delays by the round trip and caps bandwidth.

use std::time::{Duration, Instant};

use tandem_tests::link::{Link, LinkSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An echo server on 127.0.0.1.
async fn echo() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// Sends `bytes` through the link and reads them back; returns the time taken.
async fn round_trip(link: &Link, bytes: usize) -> Duration {
    let mut s = tokio::net::TcpStream::connect(link.addr)
        .await
        .expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let start = Instant::now();
    let sent = vec![7u8; bytes];
    let (mut r, mut w) = s.split();
    let mut back = vec![0u8; bytes];
    let (wrote, read) = tokio::join!(w.write_all(&sent), r.read_exact(&mut back));
    wrote.expect("write");
    read.expect("read");
    assert_eq!(back, sent);
    start.elapsed()
}

#[tokio::test]
async fn the_link_adds_its_round_trip_and_caps_its_bandwidth() {
    let upstream = echo().await;
    let rtt = Link::start(
        upstream,
        LinkSpec {
            rtt: Duration::from_millis(40),
            bits_per_second: None,
        },
    )
    .await
    .expect("link");
    // The delay is a floor the link guarantees; the ceiling only says it is not much more (a
    // loaded machine may add scheduling delay, not seconds).
    let t = round_trip(&rtt, 10).await;
    assert!(
        t >= Duration::from_millis(40) && t < Duration::from_secs(4),
        "{t:?}"
    );

    // 100 KB at 2 Mbit/s each way: at least 0.4 s (the two directions overlap).
    let narrow = Link::start(
        upstream,
        LinkSpec {
            rtt: Duration::ZERO,
            bits_per_second: Some(2e6),
        },
    )
    .await
    .expect("link");
    let t = round_trip(&narrow, 100_000).await;
    assert!(t >= Duration::from_millis(400), "{t:?}");
    let wide = round_trip(&rtt, 100_000).await;
    assert!(wide < t, "unlimited {wide:?} vs 2 Mbit/s {t:?}");
}
