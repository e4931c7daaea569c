"""What the tests share: engines, servers, HTTP helpers, benchmark runs (``import support``).

pytest's rootdir conftest puts tests/ on the import path, so every test imports this module by
name; tests/conftest.py holds the fixtures and ``ENGINE_COMMON`` (every test engine's settings).
Importing this module sets the test environment: Triton's interpreter on CPU (Triton reads it
when first imported) and SGLang's strict memory checks for every engine and server the tests start.

    start_engine(kind, model, **kw)   plain SGLang (``sglang``) or sgl_kara (``kara``), tracked
    flush_when_idle(engine)           flush once SGLang lets go of the last batch
    Server([...])                     a launched ``python -m sgl_kara.launch_server``
    generate(target, prompt, ...)     POST /generate (text, or token ids), the raw response
    generated(target, prompt, ...)    the same, asserted 200, as JSON
    run_bench(module, *args)          ``python -m bench.<module>`` in a child, asserted to succeed
    FakeReq(...)                      an SGLang request as the scheduler code reads it, without SGLang
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import subprocess
import sys
import time
import types

import torch

from bench.engine_env import engine_env as _bench_engine_env
from bench.ports import free_port  # noqa: F401  (re-exported: one free-port helper for tests and bench)
from bench.server_start import start_on_a_port

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

STRICT_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
}
os.environ.update(STRICT_ENV)

from engine_forkserver import forkserver_pid, spawn_as_forkserver  # noqa: E402

from bench.models.proxy import PROXY_MODEL_DIR  # noqa: E402  (after the environment above)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROXY_MODEL = str(
    PROXY_MODEL_DIR
)  # the reasoning proxy: the tests' fast real-weight model


def engine_env(**extra: str):
    """Environment for spawning SGLang processes (restored on exit): no Triton interpreter, plus
    ``extra`` variables (bench/engine_env.py, OpenMP left as it is)."""
    return _bench_engine_env(0, **extra)


def engine_common() -> dict:
    """Every test engine's settings, ``ENGINE_COMMON`` of tests/conftest.py."""
    from conftest import ENGINE_COMMON

    return ENGINE_COMMON


# -------------------------------------------------------------------------------- engines
PYTEST_CONFIG = None  # set by tests/conftest.py's pytest_configure (the guard prints captured output)
_LIVE_ENGINE_PROCS: dict[int, list] = {}  # id(engine) -> its watched child processes


def _watchdog(engine):
    """SGLang's watchdog of the engine's child processes (None: none)."""
    return getattr(
        getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None
    )


def track(engine, shared: bool = False) -> None:
    """Guard this process against SGLang's kill-the-tree handlers and remember ``engine``'s
    children until it shuts down. An engine of a test's own (not ``shared``) closes the session's
    shared engines before its shutdown, which kills every child of the process."""
    guard_pytest_process()
    _LIVE_ENGINE_PROCS[id(engine)] = list(
        getattr(_watchdog(engine), "_processes", None) or []
    )
    shutdown = engine.shutdown

    def shutdown_and_untrack():
        _LIVE_ENGINE_PROCS.pop(id(engine), None)
        forget_at_exit(engine)
        if not shared:
            for pool in SHARED_ENGINES:
                pool.close()
        shutdown()

    engine.shutdown = shutdown_and_untrack


def forget_at_exit(engine) -> None:
    """Drop the ``shutdown`` SGLang's Engine registers with atexit: once stopped here, a second
    shutdown at interpreter exit would only log to pytest's closed capture streams."""
    atexit.unregister(type(engine).shutdown.__get__(engine))


def stop_engine(engine) -> None:
    """Stop one engine alone: its own processes (schedulers and detokenizer, with their children)
    are killed and its event-loop tasks released; other live engines keep running (SGLang's
    ``Engine.shutdown`` kills every child of the process). For the shared engines of the tests."""
    import psutil

    from sgl_kara.engine import release_loop_tasks

    procs = _LIVE_ENGINE_PROCS.pop(id(engine), [])
    forget_at_exit(engine)
    watchdog = _watchdog(engine)
    if watchdog is not None:
        watchdog.stop()  # the kill below is no crash to report
    victims = []
    for p in procs:
        try:
            root = psutil.Process(p.pid)
            victims += [*root.children(recursive=True), root]
        except psutil.Error:
            pass
    for v in victims:
        try:
            v.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(victims, timeout=30)
    for p in procs:
        p.join(timeout=5)
    release_loop_tasks(engine)


def guard_pytest_process():
    """SGLang's SIGQUIT handlers (launch phase, and the running phase one its TokenizerManager
    registers on the event loop) call ``kill_process_tree(os.getpid())``, which SIGKILLs pytest
    itself with all captured output when any child dies: CI then shows only "Killed". In the
    test process, kill the children, print which test was running (bypassing capture), exit 3."""
    import sglang.srt.entrypoints.engine as engine_mod
    import sglang.srt.managers.tokenizer_manager as tm_mod
    from sglang.srt.utils import kill_process_tree

    if getattr(engine_mod.kill_process_tree, "_sgl_kara_guard", False):
        return

    def guarded(pid, include_parent=True, *args, **kwargs):
        if pid == os.getpid() and not include_parent and not args:
            # Engine.shutdown: every child of this process but the engines' fork server
            # (tests/engine_forkserver.py; its children, the engines' processes, are killed).
            kwargs.setdefault("skip_pid", forkserver_pid())
        if pid != os.getpid() or not include_parent:
            return kill_process_tree(pid, include_parent, *args, **kwargs)
        if all(p.is_alive() for procs in _LIVE_ENGINE_PROCS.values() for p in procs):
            # Every child of every engine still open is alive: the SIGQUIT cannot be about them
            # (defensive; the crash traced in CI was a live engine's children being killed).
            sys.stderr.write(
                "support: ignoring a SIGQUIT while every live engine's children are alive\n"
            )
            return None
        kill_process_tree(pid, False, *args, **kwargs)
        capman = PYTEST_CONFIG and PYTEST_CONFIG.pluginmanager.getplugin(
            "capturemanager"
        )
        if capman is not None:
            capman.suspend_global_capture(in_=True)
            out, err = capman.read_global_capture()
            sys.stderr.write(out[-20000:] + err[-20000:])
        sys.stderr.write(
            f"\nFATAL: an SGLang child process failed during {os.environ.get('PYTEST_CURRENT_TEST')}; "
            "SGLang asked to kill the process tree. Exiting.\n"
        )
        sys.stderr.flush()
        os._exit(3)

    guarded._sgl_kara_guard = True
    engine_mod.kill_process_tree = guarded
    tm_mod.kill_process_tree = guarded


def release_tasks_on_shutdown(engine) -> None:
    """Vanilla sglang.Engine: the cleanup sgl_kara.Engine.shutdown does."""
    from sgl_kara.engine import shutdown_cleanly

    engine.shutdown = functools.partial(shutdown_cleanly, engine, engine.shutdown)


SHARED_ENGINES: list = []  # the session's engine pool (tests/conftest.py EnginePool), closed before another start


def start_engine(kind: str, model_path: str, shared: bool = False, **kwargs):
    """kind: 'sglang' (plain SGLang with sgl_kara's CPU defaults) or 'kara' (``sgl_kara.Engine``),
    with ``engine_common()`` under ``kwargs``. SGLang's ``Engine.shutdown`` kills every child of
    the process (README, One Engine per process), so the session's shared engines are stopped
    first (unless this start is the pool's own, ``shared``)."""
    if not shared:
        for pool in SHARED_ENGINES:
            pool.close()
    guard_pytest_process()
    # An idle SGLang scheduler polls its sockets without pause (~0.3 of a core on this CPU), which the
    # test process's own work (references, the next engine's start) and shared engines would pay
    # for: ``sleep_on_idle`` parks it on its sockets until a request comes (SGLang's IdleSleeper).
    opts = {**engine_common(), "sleep_on_idle": True, **kwargs}
    with engine_env(), spawn_as_forkserver():
        if kind == "sglang":
            import sglang

            from sgl_kara.cpu.server import cpu_defaults

            engine = sglang.Engine(model_path=model_path, **cpu_defaults(), **opts)
            release_tasks_on_shutdown(engine)
        elif kind == "kara":
            import sgl_kara

            engine = sgl_kara.Engine(model_path=model_path, **opts)
        else:
            raise ValueError(f"start_engine: kind is 'sglang' or 'kara' (got {kind!r})")
    track(engine, shared)
    return engine


def flush_when_idle(engine, timeout: float = 30.0) -> bool:
    """engine.flush_cache() until it succeeds: SGLang refuses a flush while its scheduler still
    holds the last (already answered) batch for an iteration or two, which is a race, not a leak.
    A leaked slot fails SGLang's strict idle memory check inside the scheduler instead."""
    deadline = time.time() + timeout
    while True:
        if engine.flush_cache().success:
            return True
        if time.time() > deadline:
            return False
        time.sleep(0.2)


# -------------------------------------------------------------------------------- servers
class Server:
    """``python -m sgl_kara.launch_server --port P *args`` (or another ``module``), started and
    waited for (/health 200); its output goes to a log file (``log_text()``)."""

    def __init__(
        self,
        args: list[str],
        timeout: float = 240,
        env: dict | None = None,
        module: str = "sgl_kara.launch_server",
        port: int | None = None,
        log_tag: str = "",
    ):
        self.args, self.module = list(args), module
        full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        full_env.update(env or {})

        # A port this class picks may still be taken by another process between the pick and the
        # server's bind: the server then cannot serve, so it is stopped and started on another.
        def launch(port):
            self.port, self.url = port, f"http://127.0.0.1:{port}"
            name = f"{module.split('.')[0]}_server_{port}{log_tag}.log"
            self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), name), "w")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, "--port", str(port), *args],
                stdout=self.log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
            )
            return self.proc, self.log.name

        start_on_a_port(launch, lambda proc: self.stop(), timeout, port=port)

    def stop(self):
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()


@contextlib.contextmanager
def servers_at_once(specs: dict[str, dict]):
    """Start one ``Server(**specs[name])`` per name, all at once (threads: each start is mostly
    waiting), and yield ``{name: Server}``; every server that started is stopped on exit, and a start
    that failed fails the caller with its error."""
    import threading

    started, errors = {}, []

    def start(name, kw):
        try:
            started[name] = Server(**kw)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=item) for item in specs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def _url(target) -> str:
    return target if isinstance(target, str) else target.url


def generate(
    target,
    prompt,
    sampling_params: dict | list[dict] | None = None,
    custom: dict | None = None,
    rid=None,
    timeout: float = 300,
    **body,
):
    """POST ``target``/generate (a Server or a URL): ``prompt`` is text, a list of texts, or a list
    of token ids; ``sampling_params`` one dict, or one per text of a list; ``custom``: the
    request's ``custom_params`` (e.g. ``{"kara": {...}}``); more body fields (``stream``,
    ``return_logprob``, ...) as keywords. The raw ``requests`` response."""
    import requests

    if isinstance(sampling_params, list):
        sp = [
            dict(p) if custom is None else {**p, "custom_params": custom}
            for p in sampling_params
        ]
    else:
        sp = dict(sampling_params or {})
        if custom is not None:
            sp["custom_params"] = custom
    payload = {"sampling_params": sp, **body}
    ids = isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
    payload["input_ids" if ids else "text"] = prompt
    if rid is not None:
        payload["rid"] = rid
    return requests.post(_url(target) + "/generate", json=payload, timeout=timeout)


def generated(
    target,
    prompt,
    sampling_params: dict | None = None,
    custom: dict | None = None,
    **kw,
):
    """``generate``, asserted 200; its JSON."""
    r = generate(target, prompt, sampling_params, custom, **kw)
    assert r.status_code == 200, r.text[:500]
    return r.json()


# -------------------------------------------------------------------------------- benchmarks
def run_bench(
    module: str, *args: str, timeout: float = 900
) -> subprocess.CompletedProcess:
    """``python -m bench.<module> *args`` from the repository root, in a child without
    TRITON_INTERPRET (engines run torch attention); fails the test with the script's stderr tail
    when it exits nonzero."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


# -------------------------------------------------------------------------------- fake requests
class FakeReq:
    """What sgl_kara's scheduler code reads of an SGLang ``Req``, without SGLang: ``rid``, the
    prompt (``origin_input_ids``) and output so far (``output_ids``), ``sampling_params.
    max_new_tokens``, ``kv`` (``ReqKvInfo``: ``req_pool_idx``, ``kv_committed_len``,
    ``kv_allocated_len``, ``cache_protected_len``), the Kara state (``kara``) and ``to_finish``.
    Token ids are positions unless ``tokens`` gives them."""

    def __init__(
        self,
        rid=0,
        prompt: int = 16,
        generated: int = 0,
        max_new: int = 128,
        kara=None,
        row: int | None = None,
        tokens: list[int] | None = None,
        protected: int = 0,
    ):
        tokens = list(range(prompt + generated)) if tokens is None else list(tokens)
        self.rid = str(rid) if not isinstance(rid, str) else rid
        self.origin_input_ids, self.output_ids = tokens[:prompt], tokens[prompt:]
        self.sampling_params = types.SimpleNamespace(max_new_tokens=max_new)
        length = len(tokens)
        self.kv = types.SimpleNamespace(
            req_pool_idx=rid if row is None else row,
            kv_committed_len=length,
            kv_allocated_len=length,
            cache_protected_len=protected,
        )
        self.kara = kara
        self.to_finish = None

    def finished(self) -> bool:
        return len(self.output_ids) >= self.sampling_params.max_new_tokens


# -------------------------------------------------------------------------------- policy inputs
# Shapes of the policy-level tests: B requests, regions of M keys, H_q / H_kv heads of size D, LAYERS.
B, M, HQ, HKV, D, LAYERS = 2, 40, 4, 2, 16, 3


def make_policy(name: str, **opts):
    """A registered policy with ``opts`` (its own option names, without the policy's prefix),
    built and validated through KaraConfig as the server builds it."""
    from sgl_kara.config import KaraConfig
    from sgl_kara.policies import base

    policy = KaraConfig.build(
        policy=name, **{base.policy_class(name).prefix + k: v for k, v in opts.items()}
    ).make_policy()
    if policy.needs_tokens:
        policy.bind_vocabulary(TEST_VOCABULARY)
    return policy


# A policy that reads token ids (needs_tokens) gets this vocabulary in the policy-level tests:
# ids 0-9 the digits, 10 ".", 11 ",", the rest words.
TEST_VOCABULARY = (
    [str(i) for i in range(10)] + [".", ","] + [f" w{i}" for i in range(20)]
)


def region_tokens(policy, seed: int = 0, batch: int = B, m: int = M):
    """[batch, m] random token ids of TEST_VOCABULARY (digit runs, separators, words) for a
    needs_tokens policy's select; None for the others."""
    import torch

    if not policy.needs_tokens:
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(TEST_VOCABULARY), (batch, m), generator=g)


def select(policy, scores, keep: int, seed: int = 0):
    """``policy.select``, with random region tokens for a needs_tokens policy."""
    tokens = region_tokens(policy, seed, scores.shape[0], scores.shape[-1])
    if tokens is None:
        return policy.select(scores, keep)
    return policy.select(scores, keep, tokens=tokens)


def row_view(
    length: int,
    protected: int = 10,
    frontier: int | None = None,
    offset: int = 0,
    **request,
):
    """A RowView of a request whose row holds ``length`` entries (its own options in
    ``request``: ``retention``, ``budget``)."""
    from sgl_kara.policies.base import RowView
    from sgl_kara.scheduler.state import KaraReqState

    return RowView(
        protected,
        protected if frontier is None else frontier,
        length,
        offset,
        KaraReqState(request=request),
    )


def score_input(policy, layer: int = 0, seed: int = 0):
    """A ScoreInput for ``policy`` on random keys (and queries, and decode observations, when the
    policy reads them): B rows, each with a region of M keys at random slots of a 200-slot pool."""
    from sgl_kara.policies import base

    g = torch.Generator().manual_seed(seed)
    k_buffer = torch.randn(200, HKV, D, generator=g)
    slots = torch.stack([torch.randperm(200, generator=g)[:M] for _ in range(B)])
    rows = [row_view(M + 60) for _ in range(B)]
    region = base.Region(10, M, 12, 50, 8 if policy.needs_queries else 0)
    q = (
        torch.randn(B, region.query_len, HQ, D, generator=g)
        if policy.needs_queries
        else None
    )
    if policy.observes_decode:
        for r in rows:
            r.state.policy_state[policy.name] = {
                layer: torch.rand(HKV, 120, generator=g)
            }
    return base.ScoreInput(layer, q, k_buffer, slots, rows, [region] * B)


def run_module(args: list[str], cwd: str) -> str:
    """``python -m <args>`` in a process of its own (one OpenMP thread, passive, the repository
    root on the path, no Triton interpreter), as a user runs a harness; its stdout. Fails the
    test with the output's tail when it exits non-zero."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = root
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@contextlib.contextmanager
def policy_registry_restored():
    """The policy registry as it was, once the block ends: a policy file imported inside it
    (bench/policies/ registers on import) is seen by no later test of the process."""
    from sgl_kara.policies import base

    saved = dict(base._REGISTRY)
    try:
        yield
    finally:
        base._REGISTRY.clear()
        base._REGISTRY.update(saved)
