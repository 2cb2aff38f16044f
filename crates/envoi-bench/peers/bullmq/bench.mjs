// BullMQ side of envoi-bench's `redis_vs_bullmq` scenario.
//
//   node bench.mjs --n N --url redis://HOST:PORT[/DB] --queue NAME
//                  [--workers W] [--concurrency C] [--chunk K]
//
// Starts W worker processes (this file again, with --worker), waits until
// every one is running, then starts the clock and enqueues N jobs of the
// bench's ~100-byte JSON payload with `Queue.addBulk` in chunks of K. The
// no-op processor counts the jobs it ran; each worker reports its count and
// the time of its last job to this process. When the counts add up to N it
// prints
//   handled=<jobs> seconds=<from the first enqueue to the last job run>
//   peak_rss_kb=<this process's peak RSS>
// closes the workers and obliterates the queue.
//
// Configuration (see the bench README): one Worker per CPU core in its own
// process (BullMQ's "Parallelism and Concurrency" guide), concurrency 50 each
// (the value of its "Concurrency" guide's example; the processor is
// asynchronous and does no work), and completed jobs removed as they
// complete (`removeOnComplete`, "Going to production": keep Redis's memory
// bounded), which is also what envoi does with a handled message.

import { fork } from "node:child_process";
import { fileURLToPath } from "node:url";
import { Queue, Worker } from "bullmq";

function parseArgs(argv) {
  const opts = { n: 0, url: "", queue: "", workers: 2, concurrency: 50, chunk: 1000, worker: false };
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
  if (!opts.url || !opts.queue || !(opts.n > 0)) {
    throw new Error("--n, --url and --queue are required");
  }
  return opts;
}

function connection(url) {
  const u = new URL(url);
  if (u.protocol !== "redis:") throw new Error(`--url must be redis://…, not ${url}`);
  const db = u.pathname.replace(/^\//, "");
  return {
    host: u.hostname || "127.0.0.1",
    port: Number(u.port || 6379),
    db: db ? Number(db) : 0,
    password: u.password ? decodeURIComponent(u.password) : undefined,
    maxRetriesPerRequest: null,
  };
}

// The bench's payload: the same ~100-byte shape on every side.
function payload(id) {
  const pad = (v, w) => String(v).padStart(w, "0");
  return {
    id,
    order: `order-${pad(id, 8)}`,
    customer: `customer-${pad(id % 1000, 5)}`,
    amount_cents: 1000 + (id % 9000),
    currency: "EUR",
  };
}

// A worker process: processes jobs until told to stop, reporting its count
// and the time of its last job every 10 ms while they change.
async function worker(opts) {
  let count = 0;
  let last = 0;
  const w = new Worker(
    opts.queue,
    async () => {
      count++;
      last = performance.timeOrigin + performance.now();
    },
    { connection: connection(opts.url), concurrency: opts.concurrency },
  );
  await w.waitUntilReady();
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
      await w.close();
      clearInterval(timer);
      process.send({ count, last }, () => process.disconnect());
    }
  });
}

async function main(opts) {
  const queue = new Queue(opts.queue, { connection: connection(opts.url) });
  await queue.waitUntilReady();
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
        console.error(`BullMQ worker process exited with ${code}`);
        process.exit(1);
      }
    });
    children.push(child);
  }
  await allReady;
  const start = performance.timeOrigin + performance.now();
  const jobOpts = { removeOnComplete: true, removeOnFail: 1000 };
  for (let first = 0; first < opts.n; first += opts.chunk) {
    const jobs = [];
    for (let id = first; id < Math.min(opts.n, first + opts.chunk); id++) {
      jobs.push({ name: "job", data: payload(id), opts: jobOpts });
    }
    await queue.addBulk(jobs);
  }
  const produced = performance.timeOrigin + performance.now();
  console.error(`  bullmq: enqueued ${opts.n} in ${((produced - start) / 1000).toFixed(3)}s`);
  await allDone;
  const exits = children.map((c) => new Promise((resolve) => c.on("exit", resolve)));
  for (const c of children) c.send({ stop: true });
  await Promise.all(exits);
  const handled = counts.reduce((a, b) => a + b, 0);
  const end = Math.max(...lasts);
  console.log(
    `handled=${handled} seconds=${((end - start) / 1000).toFixed(6)} peak_rss_kb=${process.resourceUsage().maxRSS}`,
  );
  await queue.obliterate({ force: true });
  await queue.close();
}

const opts = parseArgs(process.argv.slice(2));
(opts.worker ? worker(opts) : main(opts)).catch((e) => {
  console.error(e);
  process.exit(1);
});
