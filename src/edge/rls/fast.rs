//! The RLS fast path: `ShouldRateLimit` answered beside tonic's generic gRPC stack, not through it.
//!
//! Every Envoy request's path is this one call, and tonic serves it through layers built for any
//! gRPC method: axum's router (a path match and its parameters per request), tonic's streaming
//! decoder and encoder (buffers, a stream of one message each way), each boxed. A profile of a
//! hot tenant put HTTP/2 framing and these layers at about 30 % of a decision's CPU. This layer,
//! inside tonic's server (so connection caps, TLS, `grpc-timeout`, and error recovery stay
//! tonic's), takes the RLS method's requests before the router: it reads the body, decodes the
//! one message, asks [`RateLimitGrpc::answer_traced`] (the same code tonic's service calls, so
//! answers, headers, metrics and traces are the same), and writes the answer as one data frame
//! and its trailers.
//!
//! Only the plain case is served here: one uncompressed message within the size limit that
//! decodes. Anything else (a compressed message, an encoding header, several messages, a body
//! longer than one message may be, bytes that are not a `RateLimitRequest`) goes to tonic with
//! the bytes read and the rest of the body, so its answer is tonic's, word for word; the path
//! holds at most one message's worth of a body. `tests/fast_path.rs` holds both paths to the
//! same answers.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{HeaderMap, HeaderValue, Request, Response};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use futures::future::{BoxFuture, Either};
use futures::StreamExt as _;
use http_body_util::{BodyExt as _, BodyStream, StreamBody};
use hyper::body::{Bytes, Frame};
use prost::Message as _;
use tonic::body::Body;
use tonic::metadata::MetadataMap;

use super::RateLimitGrpc;

/// The method's path.
pub const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// The largest message served here: tonic's default limit for a received message, which the
/// tonic path applies to the same requests.
const MAX_MESSAGE: usize = 4 * 1024 * 1024;
// A gRPC message's prefix: a compression flag and a 4-byte length.
const PREFIX: usize = 5;

/// Serves [`PATH`] ahead of the inner service (tonic's routes).
#[derive(Clone)]
pub struct FastLayer {
    rls: Arc<RateLimitGrpc>,
}

impl FastLayer {
    /// A layer answering with `rls`.
    pub fn new(rls: Arc<RateLimitGrpc>) -> FastLayer {
        FastLayer { rls }
    }
}

impl<S> tower::Layer<S> for FastLayer {
    type Service = Fast<S>;

    fn layer(&self, inner: S) -> Fast<S> {
        Fast { rls: self.rls.clone(), inner }
    }
}

/// The service [`FastLayer`] makes.
#[derive(Clone)]
pub struct Fast<S> {
    rls: Arc<RateLimitGrpc>,
    inner: S,
}

impl<S> tower::Service<Request<Body>> for Fast<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Either<BoxFuture<'static, Result<Response<Body>, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        if request.uri().path() != PATH {
            return Either::Right(self.inner.call(request));
        }
        if request.headers().contains_key("grpc-encoding") {
            fell_back();
            return Either::Right(self.inner.call(request));
        }
        // The inner service was made ready for this call; the fallback takes it with the request.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        Either::Left(Box::pin(serve(self.rls.clone(), inner, request)))
    }
}

async fn serve<S>(
    rls: Arc<RateLimitGrpc>,
    inner: S,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: tower::Service<Request<Body>, Response = Response<Body>>,
{
    let (parts, mut body) = request.into_parts();
    // Read at most one message's worth: past it the body is not a plain request, and what a client
    // sends beyond it is tonic's to refuse (by the length prefix, as it always did), not bytes
    // this path holds.
    let mut read = Vec::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => read.extend_from_slice(frame.data_ref().map_or(&[][..], |d| d.as_ref())),
            // What tonic answers to a body that fails midway.
            Err(error) => return Ok(tonic::Status::from_error(error.into()).into_http()),
        }
        if read.len() > PREFIX + MAX_MESSAGE {
            return fall_back(inner, parts, read, body).await;
        }
    }
    let Some(message) = plain_message(&read).and_then(|m| RateLimitRequest::decode(m).ok()) else {
        return fall_back(inner, parts, read, body).await;
    };
    let metadata = MetadataMap::from_headers(parts.headers);
    Ok(match rls.answer_traced(&metadata, &message).await {
        Ok(response) => answer(&response),
        Err(status) => status.into_http(),
    })
}

fn fell_back() {
    metrics::counter!("tollgate_rls_fast_path_fallbacks_total").increment(1);
}

// Hands the request to tonic: the bytes read, then whatever of the body is still to come.
async fn fall_back<S>(
    mut inner: S,
    parts: axum::http::request::Parts,
    read: Vec<u8>,
    rest: Body,
) -> Result<Response<Body>, S::Error>
where
    S: tower::Service<Request<Body>, Response = Response<Body>>,
{
    fell_back();
    let first = futures::stream::once(async move { Ok(Frame::data(Bytes::from(read))) });
    let body = StreamBody::new(first.chain(BodyStream::new(rest)));
    inner.call(Request::from_parts(parts, Body::new(body))).await
}

// The message of a body that is exactly one uncompressed message within the limit.
fn plain_message(body: &[u8]) -> Option<&[u8]> {
    let (prefix, message) = body.split_at_checked(PREFIX)?;
    let len = u32::from_be_bytes(prefix[1..].try_into().ok()?) as usize;
    (prefix[0] == 0 && len == message.len() && len <= MAX_MESSAGE).then_some(message)
}

// A unary gRPC answer: the headers, one data frame, and the OK status in the trailers.
fn answer(response: &impl prost::Message) -> Response<Body> {
    let len = response.encoded_len();
    let mut frame = Vec::with_capacity(PREFIX + len);
    frame.push(0);
    frame.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    response.encode_raw(&mut frame);
    let mut trailers = HeaderMap::with_capacity(1);
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let frames = [Frame::data(Bytes::from(frame)), Frame::trailers(trailers)];
    let body = StreamBody::new(futures::stream::iter(frames.map(Ok::<_, Infallible>)));
    let mut http = Response::new(Body::new(body));
    http.headers_mut().insert("content-type", HeaderValue::from_static("application/grpc"));
    http
}
