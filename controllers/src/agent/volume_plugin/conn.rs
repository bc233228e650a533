//! Caller connections with a deadline: a connection that sends no request for
//! `--volume-plugin-idle-timeout` after it was opened or after its last answer began is
//! closed (an engine opens one per call; an idle one only holds a file descriptor). A
//! request being answered is never cut: a Mount may wait minutes for its publish.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::time::{Instant, Sleep};

/// The endpoint's listener: its connections carry the idle deadline.
pub struct Listener {
    inner: UnixListener,
    idle: Duration,
}

impl Listener {
    pub fn new(inner: UnixListener, idle: Duration) -> Listener {
        Listener { inner, idle }
    }
}

impl axum::serve::Listener for Listener {
    type Io = Conn;
    type Addr = tokio::net::unix::SocketAddr;

    async fn accept(&mut self) -> (Conn, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => return (Conn::new(stream, self.idle), addr),
                Err(e) => {
                    // Out of descriptors, a connection reset before accept: wait a
                    // little and go on (the listener itself stays).
                    tracing::warn!(error = %e, "volume-plugin: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// One caller connection: reads end (as if closed) once it has been idle past its
/// deadline while no request was pending.
pub struct Conn {
    stream: UnixStream,
    idle: Duration,
    /// A request was read and its answer has not begun.
    pending: bool,
    deadline: Pin<Box<Sleep>>,
}

impl Conn {
    fn new(stream: UnixStream, idle: Duration) -> Conn {
        Conn {
            stream,
            idle,
            pending: false,
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }

    /// The connection's socket (its peer's credentials).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.pending = true;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending if !self.pending && self.deadline.as_mut().poll(cx).is_ready() => {
                // Idle past the deadline: read as closed.
                Poll::Ready(Ok(()))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write(cx, data);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) && self.pending {
            // The answer began: the connection may idle from here.
            self.pending = false;
            let next = Instant::now() + self.idle;
            self.deadline.as_mut().reset(next);
        }
        written
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
