// graphile-worker side of envoi-bench's `postgres_vs_graphile` and
// `postgres_vs_graphile_unbatched` scenarios.
//
//   node bench.mjs --mode batched|unbatched --n N --url URL --schema NAME
//                  [--workers W] [--concurrency C] [--producers P] [--chunk K]
//
// Starts W worker processes (this file again, with --worker), waits until
// every one is running, then starts the clock and enqueues N jobs of the
// bench's ~100-byte JSON payload: `addJobs` in chunks of K (batched) or one
// `addJob` per job from P concurrent producers (unbatched). The no-op task
// counts the jobs it ran; each worker reports its count and the time of its
// last job to this process. When the counts add up to N it prints
//   handled=<jobs> seconds=<from the first enqueue to the last job run>
//   peak_rss_kb=<this process's peak RSS>
// stops the workers and drops the schema.
//
// Configuration (see the bench README): the preset of graphile-worker's own
// perfTest (website/docs/performance.md): concurrentJobs 24, maxPoolSize 25,
// and for `batched` its batching options, localQueue 500 (refetchDelay
// 10 ms) and completeJobBatchDelay / failJobBatchDelay 0; `unbatched` turns
// them off (-1), the defaults.

import { fork } from "node:child_process";
import { fileURLToPath } from "node:url";
import { Logger, makeWorkerUtils, run, runMigrations } from "graphile-worker";
import pg from "pg";

const TASK = "envoi_bench_job";
const quiet = new Logger(() => () => {});

function parseArgs(argv) {
  const opts = {
    mode: "batched",
    n: 0,
    url: "",
    schema: "",
    workers: 2,
    concurrency: 24,
    producers: 64,
    chunk: 1000,
    worker: false,
  };
  for (let i = 0; i < argv.length; i++) {
    const key = argv[i].replace(/^--/, "");
    if (key === "worker") {
      opts.worker = true;
      continue;
    }
    if (!(key in opts)) throw new Error(`unknown option ${argv[i]}`);
    const value = argv[++i];
    if (value === undefined) throw new Error(`${argv[i - 1]} needs a value`);
    opts[key] = typeof opts[key] === "number" ? Number(value) : value;
    if (Number.isNaN(opts[key])) throw new Error(`${argv[i - 1]} needs a number`);
  }
  if (!opts.url || !opts.schema || !(opts.n > 0)) {
    throw new Error("--n, --url and --schema are required");
  }
  if (!["batched", "unbatched"].includes(opts.mode)) {
    throw new Error(`--mode must be batched or unbatched, not ${opts.mode}`);
  }
  if (!/^[a-z_][a-z0-9_]*$/.test(opts.schema)) {
    throw new Error(`--schema ${opts.schema} is not a plain lower-case name`);
  }
  return opts;
}

// The bench's payload: the same ~100-byte shape on every side.
export function payload(id) {
  const pad = (v, w) => String(v).padStart(w, "0");
  return {
    id,
    order: `order-${pad(id, 8)}`,
    customer: `customer-${pad(id % 1000, 5)}`,
    amount_cents: 1000 + (id % 9000),
    currency: "EUR",
  };
}

function preset(opts) {
  const batching =
    opts.mode === "batched"
      ? {
          localQueue: { size: 500, refetchDelay: { durationMs: 10 } },
          completeJobBatchDelay: 0,
          failJobBatchDelay: 0,
        }
      : { localQueue: { size: -1 }, completeJobBatchDelay: -1, failJobBatchDelay: -1 };
  return {
    worker: {
      connectionString: opts.url,
      schema: opts.schema,
      concurrentJobs: opts.concurrency,
      maxPoolSize: opts.concurrency + 1,
      ...batching,
    },
  };
}

// A worker process: runs the task until told to stop, reporting its count
// and the time of its last job every 10 ms while they change.
async function worker(opts) {
  let count = 0;
  let last = 0;
  const runner = await run({
    preset: preset(opts),
    logger: quiet,
    noHandleSignals: true,
    taskList: {
      [TASK]: async () => {
        count++;
        last = performance.timeOrigin + performance.now();
      },
    },
  });
  let sent = -1;
  const timer = setInterval(() => {
    if (count !== sent) {
      sent = count;
      process.send({ count, last });
    }
  }, 10);
  process.send({ ready: true });
  process.on("message", async (msg) => {
    if (msg.stop) {
      await runner.stop();
      clearInterval(timer);
      process.send({ count, last }, () => process.disconnect());
    }
  });
}

async function produce(opts, utils) {
  if (opts.mode === "batched") {
    for (let start = 0; start < opts.n; start += opts.chunk) {
      const end = Math.min(opts.n, start + opts.chunk);
      const specs = [];
      for (let id = start; id < end; id++) specs.push({ identifier: TASK, payload: payload(id) });
      await utils.addJobs(specs);
    }
  } else {
    const producers = [];
    for (let p = 0; p < opts.producers; p++) {
      producers.push(
        (async () => {
          for (let id = p; id < opts.n; id += opts.producers) {
            await utils.addJob(TASK, payload(id));
          }
        })(),
      );
    }
    await Promise.all(producers);
  }
}

async function main(opts) {
  await runMigrations({ preset: preset(opts), logger: quiet });
  const utils = await makeWorkerUtils({
    preset: preset(opts),
    logger: quiet,
  });
  const self = fileURLToPath(import.meta.url);
  const children = [];
  const counts = new Array(opts.workers).fill(0);
  const lasts = new Array(opts.workers).fill(0);
  let ready = 0;
  let onReady;
  let onDone;
  const allReady = new Promise((resolve) => (onReady = resolve));
  const allDone = new Promise((resolve) => (onDone = resolve));
  for (let w = 0; w < opts.workers; w++) {
    const child = fork(self, [...process.argv.slice(2), "--worker"]);
    child.on("message", (msg) => {
      if (msg.ready) {
        if (++ready === opts.workers) onReady();
        return;
      }
      counts[w] = msg.count;
      lasts[w] = msg.last;
      if (counts.reduce((a, b) => a + b, 0) >= opts.n) onDone();
    });
    child.on("exit", (code) => {
      if (code !== 0) {
        console.error(`graphile worker process exited with ${code}`);
        process.exit(1);
      }
    });
    children.push(child);
  }
  await allReady;
  const start = performance.timeOrigin + performance.now();
  await produce(opts, utils);
  const produced = performance.timeOrigin + performance.now();
  console.error(`  graphile-worker: enqueued ${opts.n} in ${((produced - start) / 1000).toFixed(3)}s`);
  await allDone;
  const exits = children.map((c) => new Promise((resolve) => c.on("exit", resolve)));
  for (const c of children) c.send({ stop: true });
  await Promise.all(exits);
  const handled = counts.reduce((a, b) => a + b, 0);
  const end = Math.max(...lasts);
  console.log(
    `handled=${handled} seconds=${((end - start) / 1000).toFixed(6)} peak_rss_kb=${process.resourceUsage().maxRSS}`,
  );
  await utils.release();
  const client = new pg.Client({ connectionString: opts.url });
  await client.connect();
  await client.query(`DROP SCHEMA IF EXISTS ${opts.schema} CASCADE`);
  await client.end();
}

const opts = parseArgs(process.argv.slice(2));
(opts.worker ? worker(opts) : main(opts)).catch((e) => {
  console.error(e);
  process.exit(1);
});
