# tollgate: a static-ish release binary on a distroless base, running as a non-root user.
#   docker build -t tollgate .
#   docker run -p 8081:8081 -p 8080:8080 -v $PWD/examples:/etc/tollgate/rules:ro tollgate
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY migrations migrations
RUN cargo build --release --locked && strip target/release/tollgate

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/tollgate /usr/local/bin/tollgate
USER nonroot
EXPOSE 8081 8080
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["serve", "--config", "/etc/tollgate/rules"]
