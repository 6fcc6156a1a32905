"""N caldrix replicas on loopback ports with nginx in front of them, on one host.

    python deploy/replicas.py 3                          # the embedded model, balancer on :8425
    python deploy/replicas.py 3 --port 8425 -- MODEL --max-batch 4 --context 4096
    python deploy/replicas.py 3 --print-config           # the nginx config, nothing started

Replica i listens on 127.0.0.1:(port + 1 + i); nginx listens on 127.0.0.1:port and spreads
requests over them (deploy/nginx.conf is the config this writes for three replicas, as shipped).
Everything after `--` is passed to each `caldrix serve`. Ctrl-C (or SIGTERM) stops nginx, then
the replicas, each with the graceful stop of docs/serve.md.

While nginx runs, a watcher thread in this process GETs every replica's /healthz every
HEALTH_INTERVAL seconds. A replica that fails HEALTH_IN_A_ROW polls in a row (not a 200 within
HEALTH_TIMEOUT: an error status, a refused connection, no answer) is marked `down` in the
config's upstream blocks and nginx is reloaded; one that then answers 200 as many times in a row
is put back the same way. nginx still does all the routing; the watcher only edits `down`.

Only loopback addresses (127.0.0.0/8) are ever written into the config: the balancer of a
cluster is the cluster's own (deploy/k8s/), not this script.

`nginx_config`, `Balancer` and `Watcher` are imported by tests/test_deploy.py and bench/replicas.py.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIPPED = HERE / "nginx.conf"
SHIPPED_RUN_DIR = "/tmp/caldrix-nginx"  # the run directory the shipped config names
AFFINITY_HEADER = "X-Session-ID"

# The active health check (Watcher). nginx 1.22 has none of its own: it notices only refused
# connections and 502/503s on requests it sends, never a replica that hangs.
HEALTH_INTERVAL = 2.0  # seconds from the start of one round of /healthz polls to the next
HEALTH_TIMEOUT = 2.0   # a poll not answered within this has failed
HEALTH_IN_A_ROW = 3    # polls in a row that must fail to take a replica out, or pass to put it back

# Keep the 413 text in step with caldrix/app.py's MAX_BODY message (routes/errors.py).
_TOO_LARGE = ('{"error":{"message":"the request body is over 4 MiB","type":"invalid_request_error",'
              '"param":null,"code":null}}')
_NO_REPLICA = ('{"error":{"message":"no replica could take the request","type":"service_unavailable_error",'
               '"param":null,"code":null}}')


def loopback(host: str) -> str:
    """`host` if it is an IPv4 loopback address (127.0.0.0/8); otherwise ValueError."""
    addr = ipaddress.ip_address(host)
    if not (addr.version == 4 and addr.is_loopback):
        raise ValueError(f"only 127.0.0.0/8 addresses may be balanced here, got {host}")
    return host


def nginx_config(replicas: list[tuple[str, int]], listen: tuple[str, int], run_dir: str,
                 down: frozenset[tuple[str, int]] = frozenset()) -> str:
    """The nginx configuration for `replicas` ((host, port) pairs, loopback only) behind
    `listen`, with nginx's pid, logs and temporary files under `run_dir`. The replicas in
    `down` are kept in the upstream blocks but marked `down`: nginx sends them nothing."""
    host, port = listen
    loopback(host)
    servers = "\n".join(f"        server {loopback(h)}:{p} max_fails=1 fail_timeout=5s"
                        f"{' down' if (h, p) in down else ''};" for h, p in replicas)
    return f"""\
# caldrix replicas behind nginx. Written by deploy/replicas.py; see docs/deploy.md.
# Run it in the foreground: nginx -p {run_dir} -c {run_dir}/nginx.conf -g 'daemon off;'

worker_processes 1;  # one process keeps least_conn's counts exact; it is not the bottleneck
pid {run_dir}/nginx.pid;
error_log stderr warn;

events {{
    worker_connections 1024;
}}

http {{
    log_format caldrix '$remote_addr [$time_iso8601] "$request" $status '
                       'session="$http_x_session_id" upstream="$upstream_addr" '
                       'upstream_status="$upstream_status" time=$request_time';
    access_log {run_dir}/access.log caldrix;

    client_body_temp_path {run_dir}/body;
    proxy_temp_path {run_dir}/proxy;
    fastcgi_temp_path {run_dir}/fastcgi;
    uwsgi_temp_path {run_dir}/uwsgi;
    scgi_temp_path {run_dir}/scgi;

    # Affinity: a request that carries an {AFFINITY_HEADER} header goes to the replica its value
    # hashes to (consistent hashing: adding or losing a replica moves about 1/N of the keys),
    # so the prompt rows that replica holds for the session are reused. Others go to the
    # replica with the fewest open requests.
    map $http_x_session_id $caldrix_pool {{
        ""      caldrix_spread;
        default caldrix_affine;
    }}

    upstream caldrix_spread {{
        zone caldrix_spread 64k;
        least_conn;
{servers}
    }}

    upstream caldrix_affine {{
        zone caldrix_affine 64k;
        hash $http_x_session_id consistent;
{servers}
    }}

    server {{
        listen {host}:{port};

        # The whole body is read before a replica is picked, so a 429 or a refused connection
        # can be retried on another replica. caldrix refuses bodies over 4 MiB; so does this.
        client_max_body_size 4m;
        client_body_buffer_size 4m;
        error_page 413 = @too_large;
        error_page 502 503 504 = @no_replica;

        location / {{
            proxy_pass http://$caldrix_pool;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;

            # Server-sent events pass through as they are written (caldrix also sends
            # X-Accel-Buffering: no on its streams).
            proxy_buffering off;
            gzip off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
            proxy_connect_timeout 2s;

            # A replica that refuses the connection, answers 502/503, or whose queue is full
            # (429) gets the request passed to one other replica. Each of these also counts as a
            # failed attempt: the replica gets no new requests for fail_timeout, then the next
            # request tries it again. Nothing is retried once the client got a byte. (A replica
            # that hangs is taken out by deploy/replicas.py's /healthz watcher, marked `down`.)
            proxy_next_upstream error http_502 http_503 http_429 non_idempotent;
            proxy_next_upstream_tries 2;
            proxy_intercept_errors off;

            # Which replicas the request went to, in order (for clients and tests).
            add_header X-Caldrix-Upstream $upstream_addr always;
        }}

        location @too_large {{
            default_type application/json;
            return 413 '{_TOO_LARGE}';
        }}

        location @no_replica {{
            default_type application/json;
            add_header X-Caldrix-Upstream $upstream_addr always;
            return 503 '{_NO_REPLICA}';
        }}
    }}
}}
"""


def shipped_config() -> str:
    """deploy/nginx.conf as shipped: three replicas on 8426-8428 behind 8425."""
    return nginx_config([("127.0.0.1", 8426 + i) for i in range(3)], ("127.0.0.1", 8425), SHIPPED_RUN_DIR)


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


class Balancer:
    """nginx in the foreground, on `listen`, in front of `replicas`. Use `start`, then `stop`;
    `set_down` rewrites which replicas are marked down and reloads nginx."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path, url: str, owns_dir: bool,
                 replicas: list[tuple[str, int]], listen: tuple[str, int]):
        self.proc = proc
        self.run_dir = run_dir
        self.url = url
        self._owns_dir = owns_dir
        self.replicas = list(replicas)
        self.listen = listen
        self.down: frozenset[tuple[str, int]] = frozenset()

    @property
    def conf(self) -> Path:
        return self.run_dir / "nginx.conf"

    @classmethod
    def start(cls, replicas: list[tuple[str, int]], listen: tuple[str, int], run_dir: Path | None = None,
              timeout: float = 20.0) -> Balancer:
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (Debian: apt-get install nginx)")
        owns = run_dir is None
        run = Path(tempfile.mkdtemp(prefix="caldrix-nginx-")) if run_dir is None else run_dir
        run.mkdir(parents=True, exist_ok=True)
        conf = run / "nginx.conf"
        conf.write_text(nginx_config(replicas, listen, str(run)))
        if os.geteuid() == 0:  # workers run as nobody and write their temporary files here
            os.chmod(run, 0o755)
        _check(binary, run, conf)
        proc = subprocess.Popen([binary, "-p", str(run), "-c", str(conf), "-g", "daemon off;"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url = f"http://{listen[0]}:{listen[1]}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"nginx exited with status {proc.returncode}:\n{proc.stderr.read()}")
            try:
                urllib.request.urlopen(url + "/healthz", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        return cls(proc, run, url, owns, replicas, listen)

    def set_down(self, down: frozenset[tuple[str, int]], timeout: float = 10.0) -> None:
        """Mark exactly the replicas in `down` as down: write the config, `nginx -t` it, then
        `nginx -s reload`, and return once nginx serves new connections with it. RuntimeError
        (the running config left as it was, or nginx still on it after `timeout`) otherwise.

        The reload is nginx's graceful one: the master starts new workers on the new config and
        tells the old ones to stop accepting; an old worker exits only once its last open
        request (a stream, say) has ended. So nothing in flight is cut."""
        binary = nginx_binary()
        assert binary is not None
        nxt = self.run_dir / "nginx.conf.next"
        nxt.write_text(nginx_config(self.replicas, self.listen, str(self.run_dir), down))
        _check(binary, self.run_dir, nxt)
        os.replace(nxt, self.conf)
        before = set(_children(self.proc.pid))
        out = subprocess.run([binary, "-s", "reload", "-p", str(self.run_dir), "-c", str(self.conf)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"nginx -s reload failed:\n{out.stderr}")
        # Done when a new worker runs and every old one has exited or says it is shutting down
        # (nginx retitles a worker once it stops accepting). Between the two, for about 100 ms,
        # both accept connections.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = _children(self.proc.pid)
            if set(now) - before and all(pid not in now or "shutting down" in now[pid] for pid in before):
                self.down = down
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with status {self.proc.returncode} on reload")
            time.sleep(0.02)
        raise RuntimeError(f"nginx did not take up the new config within {timeout:.0f} s")

    def access_log(self) -> list[str]:
        path = self.run_dir / "access.log"
        return path.read_text().splitlines() if path.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: open streams finish
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        if self._owns_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _check(binary: str, run_dir: Path, conf: Path) -> None:
    check = subprocess.run([binary, "-t", "-q", "-p", str(run_dir), "-c", str(conf)], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"nginx rejected {conf}:\n{check.stderr}")


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid` (nginx's workers, under its master), with their
    titles. Linux's /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == pid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue  # it exited while we looked
    return found


class Watcher:
    """The active health check: a thread that polls every replica's /healthz and marks the
    ones that fail `down` in nginx's config (Balancer.set_down), and back up once they pass.

    Every `interval` seconds it GETs all replicas' /healthz at once, each with `timeout`. A
    poll passes on a 200 and fails on anything else: another status, a refused or reset
    connection, no answer in time (a hung or stopped process). `in_a_row` fails in a row take
    an up replica out and as many passes put a down one back, so one slow answer moves
    nothing. The changes of one round go into one reload. Each change is said on one line
    (`say`); a reload that fails is said too, and tried again after the next round.
    """

    def __init__(self, balancer: Balancer, interval: float = HEALTH_INTERVAL, timeout: float = HEALTH_TIMEOUT,
                 in_a_row: int = HEALTH_IN_A_ROW, say=None):
        self.balancer = balancer
        self.interval, self.timeout, self.in_a_row = interval, timeout, in_a_row
        self.say = say or (lambda line: print(line, flush=True))
        # Per replica: its state as nginx has it, and how many polls in a row disagreed with it.
        self.state = {r: "up" for r in balancer.replicas}
        self.streak = {r: 0 for r in balancer.replicas}
        self.changed_at: list[tuple[float, tuple[str, int], str]] = []  # (monotonic, replica, new state)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz-watcher", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def poll(self, replica: tuple[str, int]) -> str | None:
        """None if /healthz answered 200 within the timeout, else why not."""
        conn = http.client.HTTPConnection(*replica, timeout=self.timeout)
        try:
            conn.request("GET", "/healthz")
            status = conn.getresponse().status
            return None if status == 200 else f"/healthz answered {status}"
        except TimeoutError:
            return f"/healthz gave no answer within {self.timeout:g} s"
        except OSError as e:
            return f"/healthz: {e.strerror or e}"
        except http.client.HTTPException as e:
            return f"/healthz: {type(e).__name__}"
        finally:
            conn.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            results: dict[tuple[str, int], str | None] = {}
            threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, self.poll(r)), daemon=True)
                       for r in self.balancer.replicas]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self._round(results)
            self._stop.wait(max(0.0, began + self.interval - time.monotonic()))

    def _round(self, results: dict[tuple[str, int], str | None]) -> None:
        flips = {}
        for r, why in results.items():
            disagrees = (why is None) == (self.state[r] == "down")
            self.streak[r] = self.streak[r] + 1 if disagrees else 0
            if self.streak[r] >= self.in_a_row:
                flips[r] = why
        if not flips:
            return
        down = frozenset(r for r in self.state if (self.state[r] == "down") != (r in flips))
        try:
            self.balancer.set_down(down)
        except RuntimeError as e:
            self.say(f"replicas: {_clock()} could not reload nginx; will try again: {e}")
            return
        for r, why in flips.items():
            old, new = self.state[r], ("up" if self.state[r] == "down" else "down")
            self.state[r], self.streak[r] = new, 0
            self.changed_at.append((time.monotonic(), r, new))
            reason = (f"{self.in_a_row} polls in a row failed, the last: {why}" if new == "down"
                      else f"/healthz answered 200 {self.in_a_row} times in a row")
            self.say(f"replicas: {_clock()} {r[0]}:{r[1]} {old} -> {new} ({reason}); nginx reloaded")


def _clock() -> str:
    return time.strftime("%H:%M:%S", time.gmtime())


def replica_env(n: int) -> dict[str, str]:
    """The environment of each of `n` replicas on this host. Each caldrix would otherwise run an
    OpenMP team as wide as the machine, and N teams on the same cores, spinning while idle, make
    every replica many times slower (measured on a busy 2-core machine: a 12-token reply took
    23-37 s through three default replicas, 0.8-1.2 s with this environment). So unless the
    caller set them: cores // n threads each, and idle threads asleep."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def stop_replicas(procs: list[subprocess.Popen], timeout: float = 45) -> None:
    """SIGTERM every replica still running, then wait for each (a replica finishes its running
    requests first); one that outlasts `timeout` is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"replica {url} exited with status {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "/healthz", timeout=2).read() == b"ok":
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"replica {url} was not healthy within {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(prog="deploy/replicas.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("replicas", type=int, help="how many caldrix processes")
    ap.add_argument("--port", type=int, default=8425, help="the balancer's port; replicas take the next N")
    ap.add_argument("--run-dir", default=SHIPPED_RUN_DIR, help="nginx's config, pid, logs and temporary files")
    ap.add_argument("--print-config", action="store_true", help="print the nginx config and exit")
    ap.add_argument("--health-interval", type=float, default=HEALTH_INTERVAL, metavar="S",
                    help=f"seconds between rounds of /healthz polls (default {HEALTH_INTERVAL:g})")
    ap.add_argument("--health-timeout", type=float, default=HEALTH_TIMEOUT, metavar="S",
                    help=f"a /healthz poll not answered within this fails (default {HEALTH_TIMEOUT:g})")
    ap.add_argument("--health-in-a-row", type=int, default=HEALTH_IN_A_ROW, metavar="N",
                    help=f"polls in a row that take a replica out or put it back (default {HEALTH_IN_A_ROW})")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error(f"argument replicas: must be >= 1, got {args.replicas}")
    if not (args.health_interval > 0 and args.health_timeout > 0 and args.health_in_a_row >= 1):
        ap.error("--health-interval and --health-timeout must be > 0, --health-in-a-row >= 1")
    host = "127.0.0.1"
    ports = [args.port + 1 + i for i in range(args.replicas)]
    if args.print_config:
        sys.stdout.write(nginx_config([(host, p) for p in ports], (host, args.port), args.run_dir))
        return 0
    if nginx_binary() is None:
        raise SystemExit("deploy/replicas.py: nginx is not installed (Debian: apt-get install nginx)")

    procs: list[subprocess.Popen] = []
    balancer: Balancer | None = None
    watcher: Watcher | None = None

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    env = replica_env(args.replicas)
    try:
        for p in ports:
            cmd = [sys.executable, "-m", "caldrix", "serve", *serve_args, "--host", host, "--port", str(p)]
            print(f"replicas: OMP_NUM_THREADS={env['OMP_NUM_THREADS']} OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} "
                  f"{' '.join(cmd[1:])}", flush=True)
            procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env))
        for p, proc in zip(ports, procs):
            _wait_healthy(f"http://{host}:{p}", proc, timeout=600)
        balancer = Balancer.start([(host, p) for p in ports], (host, args.port), Path(args.run_dir))
        print(f"replicas: {len(ports)} replicas on {host}:{ports[0]}-{ports[-1]}; nginx on {balancer.url}/v1 "
              f"(config {balancer.run_dir / 'nginx.conf'}, access log {balancer.run_dir / 'access.log'})", flush=True)
        watcher = Watcher(balancer, args.health_interval, args.health_timeout, args.health_in_a_row).start()
        print(f"replicas: polling each replica's /healthz every {args.health_interval:g} s (timeout "
              f"{args.health_timeout:g} s); {args.health_in_a_row} in a row take it out or put it back", flush=True)
        # A replica that exits is left out (a refused connection moves a request on, and the
        # watcher marks it down); this script does not restart it. Only nginx ending stops all.
        reported: set[int] = set()
        while balancer.proc.poll() is None:
            for p, proc in zip(ports, procs):
                if proc.poll() is not None and p not in reported:
                    reported.add(p)
                    print(f"replicas: the replica on port {p} exited with status {proc.returncode}; "
                          f"nginx sends its requests to the others", flush=True)
            time.sleep(0.5)
        print(f"replicas: nginx exited with status {balancer.proc.returncode}; stopping the replicas", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        if watcher is not None:
            watcher.stop()
        if balancer is not None:
            balancer.stop()
        stop_replicas(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
