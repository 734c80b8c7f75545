# tollgate: a static-ish release binary on a distroless base, running as a non-root user.
#   docker build -t tollgate .
#   docker run -p 8081:8081 -p 8080:8080 -v $PWD/examples:/etc/tollgate/rules:ro tollgate
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY src src
COPY proto proto
COPY migrations migrations
RUN cargo build --release --locked && strip target/release/tollgate \
 && mkdir -p /out/usr/local/bin /out/bin \
 && cp target/release/tollgate /out/usr/local/bin/tollgate \
 && ln -s tollgate /out/usr/local/bin/ratelimit \
 && ln -s /usr/local/bin/tollgate /out/bin/ratelimit

FROM gcr.io/distroless/cc-debian12:nonroot
# Also as /bin/ratelimit (and `ratelimit` on PATH): run under that name it is envoyproxy/ratelimit's
# drop-in, configured by its environment, so Envoy Gateway's ratelimit Deployment runs it as is.
# A directory copy keeps the links links.
COPY --from=build /out/ /
USER nonroot
EXPOSE 8081 8080
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["serve", "--config", "/etc/tollgate/rules"]
