//! The `tollgate` command; src/cli/ has one module per subcommand.

mod cli;

// glibc malloc took about a fifth of the CPU of a decision under load (arena locks, consolidation
// of the many short-lived buffers of HTTP/2 and the Redis client); mimalloc's per-thread free
// lists remove most of it. See bench/RESULTS.md.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    cli::main()
}
