# Build a static capmox binary, then ship it alone in a distroless image as a non-root user.
FROM rust:1.95-bookworm AS build
RUN rustup target add x86_64-unknown-linux-musl && apt-get update \
    && apt-get install -y --no-install-recommends musl-tools && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The whole workspace: Cargo loads every member and every declared target (the fleet bench
# too) even to build one binary. tests/it (release.rs) checks these COPY lines suffice.
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY crates ./crates
COPY benches ./benches
RUN cargo build --locked --release --target x86_64-unknown-linux-musl --bin capmox

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /src/target/x86_64-unknown-linux-musl/release/capmox /capmox
USER 65532:65532
ENTRYPOINT ["/capmox"]
CMD ["run"]
