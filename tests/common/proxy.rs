//! A fault-injecting TCP proxy, between tollgate and a real redis-server.
//!
//! It forwards bytes both ways until told to misbehave ([`Fault`]): hold every reply back for a
//! while (a slow server, or a reply that arrives after the caller's deadline), drop the
//! connection when a reply comes so that the command ran but its reply is lost, or swallow
//! everything (a blackhole). It runs on its own thread and runtime, listens on loopback only, and
//! stops with everything it opened when dropped.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// How the proxy treats traffic from now on (connections already open included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything.
    Pass,
    /// Hold each reply back this long before forwarding it (order kept).
    DelayReplies(Duration),
    /// Forward requests; when a reply comes, close the client's connection instead (the command
    /// ran, its reply is lost).
    DropReplies,
    /// Forward requests, never the replies: the commands run, the replies never come.
    SwallowReplies,
    /// Accept and read, forward nothing either way.
    Blackhole,
}

/// A running proxy.
pub struct FaultProxy {
    pub port: u16,
    fault: Arc<Mutex<Fault>>,
    stop: Option<watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// A proxy on a free loopback port (with port + 10000 free too) in front of `upstream`.
    pub fn start(upstream: u16) -> FaultProxy {
        let port = super::free_port();
        let fault = Arc::new(Mutex::new(Fault::Pass));
        let (stop, stopped) = watch::channel(false);
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let shared = fault.clone();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async move {
                let listener = TcpListener::bind(("127.0.0.1", port)).await.expect("proxy port");
                ready_tx.send(()).unwrap();
                let target: SocketAddr = format!("127.0.0.1:{upstream}").parse().unwrap();
                let mut stop = stopped.clone();
                loop {
                    tokio::select! {
                        _ = stop.changed() => return,
                        accepted = listener.accept() => {
                            let Ok((client, _)) = accepted else { continue };
                            tokio::spawn(relay(client, target, shared.clone(), stopped.clone()));
                        }
                    }
                }
            });
        });
        ready.recv_timeout(Duration::from_secs(5)).expect("the proxy listens");
        FaultProxy { port, fault, stop: Some(stop), thread: Some(thread) }
    }

    /// Changes how traffic is treated.
    pub fn set(&self, fault: Fault) {
        *self.fault.lock().unwrap() = fault;
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

// One client connection: requests up, replies down, each direction as the fault says.
async fn relay(
    client: TcpStream,
    target: SocketAddr,
    fault: Arc<Mutex<Fault>>,
    mut stop: watch::Receiver<bool>,
) {
    let Ok(server) = TcpStream::connect(target).await else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up_fault = fault.clone();
    let up = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let current = *up_fault.lock().unwrap();
            if current != Fault::Blackhole && server_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    // Replies are read as they come and written by a second task, so that a delay is added to
    // each reply's arrival time instead of piling up behind earlier ones.
    let (chunks, mut queued) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let read_fault = fault.clone();
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let current = *read_fault.lock().unwrap();
            let due = match current {
                Fault::Pass => tokio::time::Instant::now(),
                Fault::DelayReplies(d) => tokio::time::Instant::now() + d,
                Fault::DropReplies => return,
                Fault::SwallowReplies | Fault::Blackhole => continue,
            };
            if chunks.send((due, buf[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    let down = async move {
        tokio::pin!(read);
        let mut reading = true;
        loop {
            tokio::select! {
                _ = &mut read, if reading => reading = false,
                chunk = queued.recv() => {
                    let Some((due, bytes)) = chunk else { return };
                    tokio::time::sleep_until(due).await;
                    if client_write.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
            }
            // The server closed (or a reply was dropped): stop once what was read is written.
            if !reading && queued.is_empty() {
                return;
            }
        }
    };
    // Either direction ending (or the proxy stopping) closes both sockets.
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = stop.changed() => {}
    }
}
