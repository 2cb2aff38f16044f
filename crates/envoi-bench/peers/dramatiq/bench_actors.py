"""The broker, the no-op actor and the counting middleware of the Dramatiq
side of envoi-bench, loaded both by `bench.py` (to send) and by the
`dramatiq` worker processes (to consume).

Configured from the environment `bench.py` sets: `BENCH_BROKER`
(`rabbitmq` or `redis`), `BENCH_URL`, `BENCH_QUEUE` and `BENCH_REPORT_DIR`.
Each worker process writes `<BENCH_REPORT_DIR>/<pid>` once it has booted and
then every 10 ms while it changes: `<jobs handled> <epoch seconds of the
last one>`.
"""

import os
import threading
import time

import dramatiq


class Counter(dramatiq.Middleware):
    """Counts the messages this process handled and when it handled the last."""

    def __init__(self, report_dir):
        self.report_dir = report_dir
        self.lock = threading.Lock()
        self.count = 0
        self.last = 0.0

    def after_process_message(self, broker, message, *, result=None, exception=None):
        now = time.time()
        with self.lock:
            self.count += 1
            self.last = now

    def after_worker_boot(self, broker, worker):
        path = os.path.join(self.report_dir, str(os.getpid()))

        def report():
            written = None
            while True:
                with self.lock:
                    state = (self.count, self.last)
                if state != written:
                    tmp = path + ".tmp"
                    with open(tmp, "w") as f:
                        f.write("%d %.6f" % state)
                    os.replace(tmp, path)
                    written = state
                time.sleep(0.01)

        threading.Thread(target=report, daemon=True).start()


def _broker():
    kind = os.environ["BENCH_BROKER"]
    url = os.environ["BENCH_URL"]
    if kind == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url)
    if kind == "redis":
        from dramatiq.brokers.redis import RedisBroker

        return RedisBroker(url=url, namespace=os.environ["BENCH_QUEUE"])
    raise SystemExit("BENCH_BROKER must be rabbitmq or redis, not %r" % kind)


broker = _broker()
broker.add_middleware(Counter(os.environ.get("BENCH_REPORT_DIR", ".")))
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=os.environ["BENCH_QUEUE"], max_retries=0)
def job(payload):
    """The no-op handler."""
