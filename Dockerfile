# Build a static capmox binary, then ship it alone in a distroless image as a non-root user.
# Both base images are pinned by digest (tests/it/supply.rs checks every FROM line), so a rebuild
# of a commit gets the same images whatever the tags point at later. No registry was reachable
# when they were pinned, so each digest is the one public projects' Dockerfiles pin for the tag:
# rust:1.95-bookworm as six Rust projects pin it; distroless static-debian12:nonroot as three do
# (e.g. github.com/kilo666mj/taskboard; one notes "as of 2026-08-26"). Check or update them with
# `crane digest IMAGE:TAG` (or `docker buildx imagetools inspect IMAGE:TAG`) before a release.
FROM rust:1.95-bookworm@sha256:6258907abe69656e41cd992e0b705cdcfabcbbe3db374f92ed2d47121282d4a1 AS build
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

FROM gcr.io/distroless/static-debian12:nonroot@sha256:afa5c872c891853ca7fcf1f12c3edb23f7eeef36189728842dd51042ff57f7ab
COPY --from=build /src/target/x86_64-unknown-linux-musl/release/capmox /capmox
USER 65532:65532
ENTRYPOINT ["/capmox"]
CMD ["run"]
