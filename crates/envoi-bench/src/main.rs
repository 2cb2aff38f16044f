//! envoi's benchmark harness: each scenario runs envoi and a baseline side by
//! side in one process and ends with one line
//! `<scenario>: envoi=<v><unit> baseline=<v><unit> ratio=<envoi/baseline>`.
//!
//! Run with: `cargo run --release -p envoi-bench -- <scenario|all>`

#![forbid(unsafe_code)]

mod alloc;
mod apalis;
mod brokers;
mod dispatch;
mod e2e;
mod harness;
mod peers;
mod pipeline;
mod report;
mod sqlite;
mod tally;

use std::process::ExitCode;

/// One runnable scenario.
struct Scenario {
    name: &'static str,
    about: &'static str,
    run: fn() -> Result<(), String>,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "dispatch_canonical",
        about: "canonical 7-step pipeline vs a tower stack of 7 pass-through layers composed statically and boxed once (dispatch_tower_static); 7 boxed layers as a second figure; no-op command handler",
        run: dispatch::canonical,
    },
    Scenario {
        name: "dispatch_observed",
        about: "pipeline + span + metrics + one idle hook vs the bare pipeline (typed dispatch)",
        run: dispatch::observed,
    },
    Scenario {
        name: "memory_e2e",
        about: "in-memory transport, send then consume N messages, vs a tokio mpsc loop",
        run: e2e::memory,
    },
    Scenario {
        name: "sqlite_e2e",
        about: "SQLite transport, send then consume N messages, vs plain sqlx with one group-committing writer on the same schema",
        run: sqlite::sqlite,
    },
    Scenario {
        name: "postgres_e2e",
        about:
            "PostgreSQL transport, send then consume N messages, vs plain sqlx grouped UNNEST inserts, pipelined claim/delete",
        run: brokers::postgres::scenario,
    },
    Scenario {
        name: "redis_e2e",
        about: "Redis Streams transport, send then consume N messages, vs raw XADD, XREADGROUP read ahead, overlapped XACK",
        run: brokers::redis::scenario,
    },
    Scenario {
        name: "amqp_e2e",
        about:
            "RabbitMQ transport, send then consume N messages, vs raw lapin with confirms and overlapped multiple acks",
        run: brokers::amqp::scenario,
    },
    Scenario {
        name: "nats_e2e",
        about:
            "NATS JetStream transport, send then consume N messages, vs raw async-nats publish, pull ahead, confirmed overlapped acks",
        run: brokers::nats::scenario,
    },
    Scenario {
        name: "sqlite_vs_apalis",
        about: "SQLite transport vs apalis-sqlite 1.0, send then consume N jobs, no-op handler",
        run: apalis::sqlite,
    },
    Scenario {
        name: "postgres_vs_apalis",
        about:
            "PostgreSQL transport vs apalis-postgres 1.0, send then consume N jobs, no-op handler",
        run: apalis::postgres,
    },
    Scenario {
        name: "redis_vs_apalis",
        about:
            "Redis Streams transport vs apalis-redis 1.0, send then consume N jobs, no-op handler",
        run: apalis::redis,
    },
    Scenario {
        name: "amqp_vs_apalis",
        about: "RabbitMQ transport vs apalis-amqp 1.0 (quorum queues), send then consume N jobs",
        run: apalis::amqp,
    },
    Scenario {
        name: "postgres_vs_graphile",
        about: "PostgreSQL transport vs graphile-worker 0.18 (npm), batched (addJobs, local queue, batched completion)",
        run: peers::postgres_vs_graphile,
    },
    Scenario {
        name: "postgres_vs_graphile_unbatched",
        about: "PostgreSQL transport vs graphile-worker 0.18 (npm), one addJob per job, no batching",
        run: peers::postgres_vs_graphile_unbatched,
    },
    Scenario {
        name: "redis_vs_bullmq",
        about: "Redis Streams transport vs BullMQ 6 (npm): addBulk, 2 worker processes of concurrency 50",
        run: peers::redis_vs_bullmq,
    },
    Scenario {
        name: "amqp_vs_dramatiq",
        about: "RabbitMQ transport vs Dramatiq 2 (PyPI): 2 processes of 8 threads",
        run: peers::amqp_vs_dramatiq,
    },
    Scenario {
        name: "redis_vs_dramatiq",
        about: "Redis Streams transport vs Dramatiq 2 (PyPI): 2 processes of 8 threads",
        run: peers::redis_vs_dramatiq,
    },
    Scenario {
        name: "amqp_vs_symfony",
        about: "RabbitMQ transport vs Symfony Messenger 5.4's AMQP transport (Debian): 2 messenger:consume",
        run: peers::amqp_vs_symfony,
    },
    Scenario {
        name: "redis_vs_symfony",
        about: "Redis Streams transport vs Symfony Messenger 5.4's Redis transport (Debian): 2 messenger:consume",
        run: peers::redis_vs_symfony,
    },
    Scenario {
        name: "postgres_vs_symfony",
        about: "PostgreSQL transport vs Symfony Messenger 5.4's Doctrine transport (Debian): 2 messenger:consume",
        run: peers::postgres_vs_symfony,
    },
    Scenario {
        name: "memory_vs_apalis",
        about: "in-memory transport vs apalis 1.0's in-memory backend (crates.io), concurrency 64 each",
        run: peers::memory_vs_apalis,
    },
    Scenario {
        name: "profile_envoi",
        about: "(profiling aid) envoi dispatch only, ENVOI_BENCH_ITERS times",
        run: dispatch::profile_envoi,
    },
    Scenario {
        name: "profile_tower",
        about: "(profiling aid) tower stack only, ENVOI_BENCH_ITERS times",
        run: dispatch::profile_tower,
    },
    Scenario {
        name: "profile_observed",
        about:
            "(profiling aid) the observed side of dispatch_observed only, ENVOI_BENCH_ITERS times",
        run: dispatch::profile_observed,
    },
    Scenario {
        name: "profile_memory",
        about: "(profiling aid) the envoi side of memory_e2e only, ENVOI_BENCH_N messages",
        run: e2e::profile_memory,
    },
];

fn usage() -> String {
    let mut s = String::from("usage: envoi-bench <scenario|all>\n\nscenarios:\n");
    for sc in SCENARIOS {
        s.push_str(&format!("  {:<22} {}\n", sc.name, sc.about));
    }
    s
}

fn main() -> ExitCode {
    let arg = std::env::args().nth(1).unwrap_or_default();
    if arg == "--side" {
        // A peer scenario's envoi side, in a process of its own.
        return peers::side_main(&std::env::args().skip(2).collect::<Vec<_>>());
    }
    let selected: Vec<&Scenario> = match arg.as_str() {
        "all" => SCENARIOS
            .iter()
            .filter(|s| !s.name.starts_with("profile_"))
            .collect(),
        "" | "-h" | "--help" => {
            print!("{}", usage());
            return ExitCode::SUCCESS;
        }
        name => match SCENARIOS.iter().find(|s| s.name == name) {
            Some(s) => vec![s],
            None => {
                eprint!("unknown scenario `{name}`\n\n{}", usage());
                return ExitCode::from(2);
            }
        },
    };
    let mut failed = false;
    for sc in selected {
        if let Err(e) = (sc.run)() {
            eprintln!("{}: error: {e}", sc.name);
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
