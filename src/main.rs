//! The `tollgate` command; src/cli/ has one module per subcommand.

mod cli;

// glibc malloc took about a fifth of the CPU of a decision under load (arena locks, consolidation
// of the many short-lived buffers of HTTP/2 and the Redis client); mimalloc's per-thread free
// lists remove most of it. See bench/RESULTS.md. Built without transparent huge pages
// (`no_thp`): mimalloc asks for them by default, and purging freed memory then faulted whole
// 2 MiB pages back in, zeroing each, a third of all CPU while three replicas set their first
// holds for 10,000 RLQS buckets (perf: `clear_page_erms` under `do_huge_pmd_anonymous_page`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    cli::main()
}
