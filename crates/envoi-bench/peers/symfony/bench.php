<?php
// Symfony Messenger side of envoi-bench's amqp_vs_symfony, redis_vs_symfony
// and postgres_vs_symfony scenarios, on the Debian packages of Symfony 5.4.
//
//   php bench.php --transport amqp|redis|doctrine --n N --url URL --queue NAME
//                 [--workers W] [--sleep SECONDS]
//
// Sets the transport up, starts W worker processes (this file again, with
// --worker I), each running Messenger's own `messenger:consume` command on
// the transport, waits until each has started, then starts the clock and
// dispatches N messages of the bench's ~100-byte payload through a bus that
// routes them to the transport (SendMessageMiddleware). The no-op handler
// counts; each worker writes its count and the time of its last message to
// a report file. When the counts add up to N it prints
//   handled=<messages> seconds=<from the first dispatch to the last handled>
//   peak_rss_kb=<this process's peak RSS>
// stops the workers with SIGTERM (StopWorkerOnSigtermSignalListener, as the
// framework registers it) and removes what the run created on the broker.
//
// Configuration (see the bench README): Messenger's defaults (the PHP
// serializer, one message per fetch), one worker process per core as the
// deployment docs suggest, the Redis transport with delete_after_ack (the
// documented way to keep the stream from growing, the default from 6.0),
// the Doctrine transport with LISTEN/NOTIFY (its PostgreSQL default), and
// `--sleep 0.05` instead of 1 s between polls of an empty transport, so a
// worker idle before the run starts notices the first message at once.

declare(strict_types=1);

const SYMFONY = '/usr/share/php/Symfony/Component';
require SYMFONY . '/Messenger/autoload.php';
require SYMFONY . '/Messenger/Bridge/Amqp/autoload.php';
require SYMFONY . '/Messenger/Bridge/Redis/autoload.php';
require SYMFONY . '/Messenger/Bridge/Doctrine/autoload.php';
require SYMFONY . '/Console/autoload.php';
require SYMFONY . '/EventDispatcher/autoload.php';
require SYMFONY . '/DependencyInjection/autoload.php';
require '/usr/share/php/Doctrine/DBAL/autoload.php';

use Doctrine\DBAL\DriverManager;
use Symfony\Component\Console\Application;
use Symfony\Component\Console\Input\ArrayInput;
use Symfony\Component\Console\Output\NullOutput;
use Symfony\Component\DependencyInjection\ServiceLocator;
use Symfony\Component\EventDispatcher\EventDispatcher;
use Symfony\Component\Messenger\Bridge\Amqp\Transport\AmqpTransport;
use Symfony\Component\Messenger\Bridge\Amqp\Transport\Connection as MessengerAmqpConnection;
use Symfony\Component\Messenger\Bridge\Doctrine\Transport\Connection as DoctrineConnection;
use Symfony\Component\Messenger\Bridge\Doctrine\Transport\DoctrineTransport;
use Symfony\Component\Messenger\Bridge\Doctrine\Transport\PostgreSqlConnection;
use Symfony\Component\Messenger\Bridge\Redis\Transport\Connection as RedisConnection;
use Symfony\Component\Messenger\Bridge\Redis\Transport\RedisTransport;
use Symfony\Component\Messenger\Command\ConsumeMessagesCommand;
use Symfony\Component\Messenger\Event\WorkerMessageHandledEvent;
use Symfony\Component\Messenger\Event\WorkerRunningEvent;
use Symfony\Component\Messenger\Event\WorkerStartedEvent;
use Symfony\Component\Messenger\EventListener\DispatchPcntlSignalListener;
use Symfony\Component\Messenger\EventListener\StopWorkerOnSigtermSignalListener;
use Symfony\Component\Messenger\Handler\HandlersLocator;
use Symfony\Component\Messenger\MessageBus;
use Symfony\Component\Messenger\Middleware\HandleMessageMiddleware;
use Symfony\Component\Messenger\Middleware\SendMessageMiddleware;
use Symfony\Component\Messenger\RoutableMessageBus;
use Symfony\Component\Messenger\Transport\Sender\SendersLocator;
use Symfony\Component\Messenger\Transport\TransportInterface;

/** The bench's message: the same ~100-byte shape on every side. */
final class Order
{
    public function __construct(
        public int $id,
        public string $order,
        public string $customer,
        public int $amount_cents,
        public string $currency,
    ) {
    }

    public static function make(int $id): self
    {
        return new self($id, sprintf('order-%08d', $id), sprintf('customer-%05d', $id % 1000), 1000 + $id % 9000, 'EUR');
    }
}

/** What this worker process handled, written to its report file. */
final class Report
{
    public static int $count = 0;
    public static float $last = 0.0;
    private static ?array $written = null;
    private static float $writtenAt = 0.0;

    public static function write(bool $force = false): void
    {
        $state = [self::$count, self::$last];
        $now = microtime(true);
        if ($state === self::$written || (!$force && $now - self::$writtenAt < 0.01)) {
            return;
        }
        $path = getenv('BENCH_REPORT_DIR') . '/' . getmypid();
        file_put_contents($path . '.tmp', sprintf('%d %.6F', ...$state));
        rename($path . '.tmp', $path);
        self::$written = $state;
        self::$writtenAt = $now;
    }
}

function options(array $argv): array
{
    $opts = ['transport' => '', 'n' => 0, 'url' => '', 'queue' => '', 'workers' => 2, 'sleep' => 0.05, 'worker' => null];
    for ($i = 1; $i < count($argv); $i += 2) {
        $key = ltrim($argv[$i], '-');
        if (!array_key_exists($key, $opts) || !isset($argv[$i + 1])) {
            fwrite(STDERR, "bad option {$argv[$i]}\n");
            exit(2);
        }
        $opts[$key] = $argv[$i + 1];
    }
    $opts['n'] = (int) $opts['n'];
    $opts['workers'] = (int) $opts['workers'];
    if ($opts['n'] <= 0 || '' === $opts['url'] || !preg_match('/^[a-z_][a-z0-9_]*$/', $opts['queue'])
        || !in_array($opts['transport'], ['amqp', 'redis', 'doctrine'], true)) {
        fwrite(STDERR, "usage: php bench.php --transport amqp|redis|doctrine --n N --url URL --queue lower_case_name\n");
        exit(2);
    }
    return $opts;
}

function dbal(string $url): Doctrine\DBAL\Connection
{
    $u = parse_url($url);
    return DriverManager::getConnection([
        'driver' => 'pdo_pgsql',
        'host' => $u['host'] ?? '127.0.0.1',
        'port' => $u['port'] ?? 5432,
        'user' => urldecode($u['user'] ?? 'postgres'),
        'password' => urldecode($u['pass'] ?? ''),
        'dbname' => ltrim($u['path'] ?? '/postgres', '/'),
    ]);
}

/** The transport of this run; `$consumer` names a Redis consumer. */
function transport(array $o, string $consumer): TransportInterface
{
    switch ($o['transport']) {
        case 'amqp':
            $connection = MessengerAmqpConnection::fromDsn(rtrim($o['url'], '/') . '/' . $o['queue'], [
                'exchange' => ['name' => $o['queue']],
                'queues' => [$o['queue'] => []],
            ]);
            return new AmqpTransport($connection);
        case 'redis':
            $connection = RedisConnection::fromDsn($o['url'], [
                'stream' => $o['queue'],
                'group' => 'bench',
                'consumer' => $consumer,
                'delete_after_ack' => true,
            ]);
            return new RedisTransport($connection);
        default:
            $config = DoctrineConnection::buildConfiguration('doctrine://default', ['table_name' => $o['queue']]);
            return new DoctrineTransport(new PostgreSqlConnection($config, dbal($o['url'])), new Symfony\Component\Messenger\Transport\Serialization\PhpSerializer());
    }
}

function cleanup(array $o): void
{
    switch ($o['transport']) {
        case 'amqp':
            $u = parse_url($o['url']);
            $conn = new \AMQPConnection([
                'host' => $u['host'] ?? '127.0.0.1', 'port' => $u['port'] ?? 5672,
                'login' => urldecode($u['user'] ?? 'guest'), 'password' => urldecode($u['pass'] ?? 'guest'),
                'vhost' => urldecode(ltrim($u['path'] ?? '/%2f', '/')) ?: '/',
            ]);
            $conn->connect();
            $channel = new \AMQPChannel($conn);
            $queue = new \AMQPQueue($channel);
            $queue->setName($o['queue']);
            $queue->delete();
            (new \AMQPExchange($channel))->delete($o['queue']);
            $conn->disconnect();
            break;
        case 'redis':
            $u = parse_url($o['url']);
            $redis = new \Redis();
            $redis->connect($u['host'] ?? '127.0.0.1', $u['port'] ?? 6379);
            $redis->del($o['queue']);
            break;
        default:
            dbal($o['url'])->executeStatement('DROP TABLE IF EXISTS ' . $o['queue']);
    }
}

/** A worker process: `messenger:consume bench` until SIGTERM. */
function worker(array $o): void
{
    $transport = transport($o, 'worker-' . $o['worker']);
    $bus = new MessageBus([new HandleMessageMiddleware(new HandlersLocator([
        Order::class => [static function (Order $order): void {
            Report::$count++;
            Report::$last = microtime(true);
        }],
    ]))]);
    $dispatcher = new EventDispatcher();
    $dispatcher->addSubscriber(new DispatchPcntlSignalListener());
    $dispatcher->addSubscriber(new StopWorkerOnSigtermSignalListener());
    $dispatcher->addListener(WorkerStartedEvent::class, static fn () => Report::write(true));
    $dispatcher->addListener(WorkerMessageHandledEvent::class, static fn () => Report::write());
    $dispatcher->addListener(WorkerRunningEvent::class, static fn (WorkerRunningEvent $e) => $e->isWorkerIdle() ? Report::write(true) : null);
    $command = new ConsumeMessagesCommand(
        new RoutableMessageBus(new ServiceLocator(['bus' => static fn () => $bus]), $bus),
        new ServiceLocator(['bench' => static fn () => $transport]),
        $dispatcher,
    );
    $app = new Application();
    $app->add($command);
    $app->setAutoExit(false);
    $app->setCatchExceptions(false);
    $app->run(new ArrayInput([
        'command' => 'messenger:consume',
        'receivers' => ['bench'],
        '--time-limit' => 600,
        '--sleep' => $o['sleep'],
    ]), new NullOutput());
    Report::write(true);
}

function reports(string $dir): array
{
    $all = [];
    foreach (glob($dir . '/*') as $file) {
        if (!str_ends_with($file, '.tmp')) {
            [$count, $last] = explode(' ', (string) file_get_contents($file));
            $all[] = [(int) $count, (float) $last];
        }
    }
    return $all;
}

function wait_for(string $what, callable $done, array $procs, float $timeout): void
{
    $deadline = microtime(true) + $timeout;
    while (!$done()) {
        foreach ($procs as $p) {
            if (!proc_get_status($p)['running']) {
                throw new RuntimeException("a worker exited while waiting for $what");
            }
        }
        if (microtime(true) > $deadline) {
            throw new RuntimeException("timed out waiting for $what");
        }
        usleep(5000);
    }
}

function main(array $o, array $argv): void
{
    $transport = transport($o, 'producer');
    $transport->setup();
    $dir = sys_get_temp_dir() . '/envoi-bench-symfony-' . getmypid() . '-' . bin2hex(random_bytes(4));
    mkdir($dir);
    putenv("BENCH_REPORT_DIR=$dir");
    $procs = [];
    for ($w = 0; $w < $o['workers']; $w++) {
        $procs[] = proc_open(array_merge([PHP_BINARY], $argv, ['--worker', (string) $w]), [STDIN, STDERR, STDERR], $pipes);
    }
    $bus = new MessageBus([new SendMessageMiddleware(new SendersLocator(
        [Order::class => ['bench']],
        new ServiceLocator(['bench' => static fn () => $transport]),
    ))]);
    try {
        wait_for('the workers to start', static fn () => count(reports($dir)) >= $o['workers'], $procs, 120.0);
        $start = microtime(true);
        for ($i = 0; $i < $o['n']; $i++) {
            $bus->dispatch(Order::make($i));
        }
        fprintf(STDERR, "  symfony: dispatched %d in %.3fs\n", $o['n'], microtime(true) - $start);
        $sum = static fn () => array_sum(array_column(reports($dir), 0));
        wait_for('the messages', static fn () => $sum() >= $o['n'], $procs, 600.0);
        $all = reports($dir);
    } finally {
        foreach ($procs as $p) {
            proc_terminate($p, SIGTERM);
        }
        foreach ($procs as $p) {
            proc_close($p);
        }
        array_map('unlink', glob($dir . '/*'));
        rmdir($dir);
    }
    cleanup($o);
    printf(
        "handled=%d seconds=%.6F peak_rss_kb=%d\n",
        array_sum(array_column($all, 0)),
        max(array_column($all, 1)) - $start,
        getrusage()['ru_maxrss'],
    );
}

$o = options($argv);
if (null !== $o['worker']) {
    worker($o);
} else {
    main($o, $argv);
}
