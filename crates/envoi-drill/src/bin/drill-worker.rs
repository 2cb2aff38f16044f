//! The worker a drill kills and restarts:
//! `drill-worker <transport name> <dsn> <record file> [--until-empty]`.
//! It consumes the transport, records each id it handles, and stops on
//! `SIGTERM`/`SIGINT` (gracefully) or, with `--until-empty`, once the
//! transport is empty.

use std::path::PathBuf;
use std::process::ExitCode;

use envoi::worker::{StopHandle, Worker};
use envoi::{Messenger, MessengerBuilderExt};
use envoi_drill::{record, Job};

/// How long each handling takes.
const HANDLING: std::time::Duration = std::time::Duration::from_millis(5);

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [name, dsn, path, rest @ ..] = args.as_slice() else {
        eprintln!("usage: drill-worker <transport name> <dsn> <record file> [--until-empty]");
        return ExitCode::from(2);
    };
    let until_empty = rest.iter().any(|a| a == "--until-empty");
    let path = PathBuf::from(path);
    let messenger = match Messenger::builder()
        .with_transport_factories()
        .event_handler(move |job: Job| {
            let path = path.clone();
            async move {
                // A handler that takes a little time, so that a kill finds
                // messages in every state: fetched, in the handler, handled
                // and not yet acknowledged.
                tokio::time::sleep(HANDLING).await;
                record(&path, job.id)
            }
        })
        .transport_dsn(name.clone(), dsn.clone())
        .route::<Job>(name.clone())
        .build_async()
        .await
    {
        Ok(m) => m,
        Err(e) => {
            eprintln!("drill-worker: {e}");
            return ExitCode::from(1);
        }
    };
    let stop = StopHandle::new();
    let _signals = stop.stop_on_signals();
    let mut worker = Worker::builder(&messenger)
        .receiver(name.clone())
        .concurrency(4)
        .stop_handle(stop);
    if until_empty {
        worker = worker.stop_when_empty();
    }
    let worker = match worker.build() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("drill-worker: {e}");
            return ExitCode::from(1);
        }
    };
    let report = worker.run().await;
    println!("handled={}", report.stats.handled);
    ExitCode::SUCCESS
}
