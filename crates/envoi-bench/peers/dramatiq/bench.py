"""Dramatiq side of envoi-bench's `amqp_vs_dramatiq` and `redis_vs_dramatiq`.

    python3 bench.py --broker rabbitmq|redis --n N --url URL --queue NAME
                     [--processes P] [--threads T]

Starts `dramatiq bench_actors --processes P --threads T`, waits until every
worker process has booted, then starts the clock and sends N messages of the
bench's ~100-byte JSON payload with one `send` each (Dramatiq has no bulk
enqueue). When the worker processes' counts add up to N it prints

    handled=<messages> seconds=<from the first send to the last handled>
    peak_rss_kb=<this process's peak RSS>

stops the workers (SIGTERM, Dramatiq's graceful shutdown) and deletes what
the run declared on the broker.

Configuration (see the bench README): Dramatiq's defaults, which its docs
give for a machine's cores: one worker process per CPU (`--processes`, 2
here) with 8 threads each, and the broker's default prefetch (twice the
threads).
"""

import argparse
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--broker", choices=["rabbitmq", "redis"], required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--processes", type=int, default=os.cpu_count() or 2)
    p.add_argument("--threads", type=int, default=8)
    args = p.parse_args(argv)
    if args.n <= 0:
        p.error("--n must be positive")
    return args


def payload(i):
    """The bench's payload: the same ~100-byte shape on every side."""
    return {
        "id": i,
        "order": "order-%08d" % i,
        "customer": "customer-%05d" % (i % 1000),
        "amount_cents": 1000 + i % 9000,
        "currency": "EUR",
    }


def read_reports(report_dir):
    counts = []
    for name in os.listdir(report_dir):
        if name.endswith(".tmp"):
            continue
        with open(os.path.join(report_dir, name)) as f:
            count, last = f.read().split()
        counts.append((int(count), float(last)))
    return counts


def wait_for(what, check, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            raise SystemExit("dramatiq exited with %s while waiting for %s" % (proc.returncode, what))
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for %s" % what)
        time.sleep(0.005)


def cleanup(args):
    if args.broker == "rabbitmq":
        import pika

        conn = pika.BlockingConnection(pika.URLParameters(args.url))
        channel = conn.channel()
        for suffix in ("", ".DQ", ".XQ"):
            channel.queue_delete(args.queue + suffix)
        conn.close()
    else:
        import redis

        client = redis.Redis.from_url(args.url)
        keys = list(client.scan_iter(match=args.queue + ":*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def main(argv):
    args = parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    report_dir = tempfile.mkdtemp(prefix="envoi-bench-dramatiq-")
    os.environ.update(
        BENCH_BROKER=args.broker,
        BENCH_URL=args.url,
        BENCH_QUEUE=args.queue,
        BENCH_REPORT_DIR=report_dir,
    )
    sys.path.insert(0, here)
    import bench_actors  # noqa: E402  (configured by the environment above)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    log_path = os.path.join(tempfile.gettempdir(), "envoi-bench-dramatiq-%d.log" % os.getpid())
    log = open(log_path, "w")
    workers = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "bench_actors",
         "--processes", str(args.processes), "--threads", str(args.threads)],
        cwd=here, env=env, stdout=log, stderr=log,
    )
    failed = True
    try:
        wait_for("the worker processes", lambda: len(read_reports(report_dir)) >= args.processes, workers)
        start = time.time()
        for i in range(args.n):
            bench_actors.job.send(payload(i))
        print("  dramatiq: sent %d in %.3fs" % (args.n, time.time() - start), file=sys.stderr)
        wait_for("the messages", lambda: sum(c for c, _ in read_reports(report_dir)) >= args.n, workers, 600.0)
        reports = read_reports(report_dir)
        handled = sum(c for c, _ in reports)
        end = max(last for _, last in reports)
        failed = False
    finally:
        workers.send_signal(signal.SIGTERM)
        workers.wait(60)
        bench_actors.broker.close()
        shutil.rmtree(report_dir, ignore_errors=True)
        log.close()
        if failed:
            # The workers' log says why; it is noise otherwise.
            with open(log_path) as f:
                sys.stderr.write(f.read()[-4000:])
        os.remove(log_path)
    cleanup(args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("handled=%d seconds=%.6f peak_rss_kb=%d" % (handled, end - start, peak))


if __name__ == "__main__":
    main(sys.argv[1:])
