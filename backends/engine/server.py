"""``headrace engine``: the built-in engine as an OpenAI-compatible HTTP server.

The OpenAI routes come from the shared frontend (:mod:`frontend.server`);
this module adds the engine's own::

    GET  /v1/models      the shared frontend's list, plus each model's ``sampling_defaults``
                         (what unset request fields get) and ``sampling_defaults_source``,
                         and what cache-aware routers read: ``block_size``, ``kv_events``
                         and ``tokenizer`` (the model file's absolute path, when known),
                         and what stream migration reads: ``exact_resume``; and ``footprint``:
                         load time and memory held (backends/engine/footprint.py)
    POST /tokenize       {"prompt": str} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}
    POST /detokenize     {"tokens": [int]} -> {"prompt": str}          (vLLM's shapes)
    GET  /v1/kv_events   SSE of KV block events; ?since=SEQ or Last-Event-ID resumes
    GET  /metrics        Prometheus: tokens/s, running/waiting, KV usage, prefix hits,
                         batch-size histogram, preemptions, per-call TTFT / ITL / latency,
                         GPUs (gpu_metrics.py); names from frontend/metric_names.py
    GET  /health         (shared frontend) 200 while the engine loop runs

The engine loop and the HTTP server share one nursery: the server is only up while
the loop runs, and a crash of either stops both.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import secrets
import sys
import time
from typing import Any, Literal, cast

import msgspec
import trio
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import HistogramMetricFamily

from backends.base import ChatMessage
from backends.engine.backend import EngineBackend, build_engine
from backends.engine.config import EngineConfig, SamplingDefaults
from backends.engine.engine import LLMEngine
from backends.engine.footprint import Footprint, measure
from backends.engine.gpu_metrics import GPUCollector
from backends.engine.host import MainThreadHost
from backends.engine.loader import default_model_path
from backends.engine.runner import resolve_device
from backends.engine.speculative import SpecConfig, make_engine
from backends.engine.tokenizer import Tokenizer
from backends.engine.tp_worker import launch_tp
from backends.errors import BadRequest, HeadraceError
from frontend import metric_names as N
from frontend.call import Call
from frontend.context import Principal, RequestContext, trace_logger
from frontend.exposition import render_cooperatively
from frontend.kv_stream import kv_events_response
from frontend.server import HTTPRequest, OpenAIServer, Response, json_response
from frontend.serving import ServeOptions, serve
from frontend.sli import ROUTE_OF_KIND, CallTimer

__all__ = ["build_app", "main", "run_server"]


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


def _decode(body: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid request body: {exc}") from None


def build_app(backend: EngineBackend, footprint: Footprint | None = None) -> OpenAIServer:
    """The shared OpenAI frontend over ``backend`` plus the engine's extra routes."""
    routes = _Routes(backend, footprint)
    return OpenAIServer(
        backend,
        extra_routes={
            ("GET", "/v1/models"): routes.models,
            ("POST", "/tokenize"): routes.tokenize,
            ("POST", "/detokenize"): routes.detokenize,
            ("GET", "/v1/kv_events"): routes.kv_events,
            ("GET", "/metrics"): routes.metrics,
        },
        coalesce=True,
        gate=routes.timer,
        authenticate=_tenant_of,  # not a credential: the router's name for whose GPU time this is
        finished=trace_logger(logging.getLogger("headrace.engine.requests")),  # a line per request, with its trace
    )


class _Routes:
    def __init__(self, backend: EngineBackend, footprint: Footprint | None = None) -> None:
        self.backend = backend
        self.footprint = msgspec.to_builtins(footprint) if footprint is not None else None
        # The router loads the same tokenizer to compute our block hashes; the
        # config's model is the file it was read from (main resolves the default).
        model_file = backend.engine.config.model
        self.tokenizer = os.path.abspath(model_file) if model_file else None
        self.kv_epoch = secrets.token_hex(8)  # this process's run of KV event numbers
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(backend))
        self.timer = _call_timer(backend, self.registry)
        self.registry.register(GPUCollector())  # headrace_gpu_*: one collector_up 0 without NVIDIA devices

    async def models(self, request: HTTPRequest) -> Response:
        info = self.backend.info()
        sampling = self.backend.sampling
        tokenizer = info.tokenizer or self.tokenizer
        data = [
            {
                "id": m,
                "object": "model",
                "created": 0,
                "owned_by": info.name,
                "max_model_len": info.max_context,
                "sampling_defaults": sampling.payload(),
                "sampling_defaults_source": sampling.source or "OpenAI defaults",
                "block_size": info.block_size,
                "kv_capacity_blocks": info.kv_capacity_blocks,
                "prefix_sharing": info.prefix_sharing,
                "kv_events": info.kv_events,
                "tokenizer": tokenizer,
                # Token ids on every event and as input (return_token_ids, resumed_tokens),
                # and a resumed request continues the unbroken one exactly (stream migration)
                "token_ids": info.token_ids,
                "exact_resume": info.exact_resume,
                "kv_epoch": self.kv_epoch,
                "footprint": self.footprint,
                "memory": self._memory(),
            }
            for m in info.models
        ]
        return json_response({"object": "list", "data": data})

    def _memory(self) -> dict[str, int] | None:
        """The runner's memory now (runner.MemoryFootprint: weights, packed layouts, KV
        reserved and resident, workspace); None for a runner that does not say."""
        memory = getattr(self.backend.engine.runner, "memory", None)
        return msgspec.to_builtins(memory()) if memory is not None else None

    async def tokenize(self, request: HTTPRequest) -> Response:
        req: TokenizeRequest = _decode(request.body, TokenizeRequest)
        tok = self.backend.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            messages = [msgspec.structs.asdict(m) for m in req.messages]
            text = tok.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt
            )
            ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = tok.encode(
                req.prompt or "", add_special_tokens=req.add_special_tokens is not False
            )
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.backend.engine.max_model_len,
            "tokens": ids,
        }
        if req.return_token_strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        return json_response(out)

    async def detokenize(self, request: HTTPRequest) -> Response:
        req: DetokenizeRequest = _decode(request.body, DetokenizeRequest)
        return json_response({"prompt": self.backend.tokenizer.decode(req.tokens)})

    async def kv_events(self, request: HTTPRequest) -> Response:
        return kv_events_response(request, self.backend.kv_events)

    async def metrics(self, request: HTTPRequest) -> Response:
        return Response(
            200,
            await render_cooperatively(self.registry),  # yielding to the loop (frontend/exposition.py)
            content_type="text/plain; version=0.0.4; charset=utf-8",
        )


def _tenant_of(headers: dict[str, str]) -> Principal:
    """The tenant the router names in ``x-headrace-tenant`` (the engine's
    accounting is by it); without one, or a malformed one, ``default``."""
    tenant = headers.get("x-headrace-tenant", "")
    return Principal(tenant=tenant if 0 < len(tenant) <= 128 and tenant.isprintable() and tenant.isascii() else "default")


class _EngineCollector:
    """Reads the engine's statistics on each scrape; names from :mod:`frontend.metric_names`."""

    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend

    def collect(self) -> Any:
        e = self.backend.engine.statistics()
        b = self.backend.statistics()
        yield N.ENGINE_TOKENS_PER_SECOND.collected(b.tokens_per_second)
        yield N.ENGINE_RUNNING.collected(e.num_running)
        yield N.ENGINE_WAITING.collected(e.num_waiting)
        yield N.ENGINE_KV_USAGE.collected(e.kv_usage)
        yield N.ENGINE_PREFIX_HIT_RATE.collected(e.prefix_hit_rate)
        yield N.ENGINE_GENERATED.collected(e.num_tokens_generated)
        yield N.ENGINE_PREEMPTIONS.collected(e.num_preemptions)
        yield N.ENGINE_STEPS.collected(e.num_steps)
        yield N.ENGINE_STEP_ERRORS.collected(b.num_step_errors)
        yield N.ENGINE_FINISHED.collected(e.num_requests_finished)
        buckets, total = [], 0
        for bound, count in sorted(b.batch_size_histogram.items()):
            total += count
            buckets.append((str(float(bound)), total))
        buckets.append(("+Inf", total))
        f = N.ENGINE_BATCH_SIZE
        yield HistogramMetricFamily(f.name, f.help, buckets=buckets, sum_value=e.mean_batch_size * e.num_steps)
        yield from _accounting(self.backend)
        spec = getattr(e, "speculative", None)  # SpecEngineStatistics when speculating
        if spec is not None:
            yield N.ENGINE_SPEC_DRAFT.collected(spec.num_draft_tokens)
            yield N.ENGINE_SPEC_ACCEPTED.collected(spec.num_accepted_tokens)
            yield N.ENGINE_SPEC_VERIFY.collected(spec.num_verified)
            yield N.ENGINE_SPEC_ACCEPTANCE.collected(spec.acceptance_rate)
            yield N.ENGINE_SPEC_PER_VERIFY.collected(spec.mean_emitted_per_verify)
            yield N.ENGINE_SPEC_CUTOFFS.collected(spec.num_batch_cutoffs)


def _accounting(backend: EngineBackend) -> Any:
    """GPU-seconds, tokens computed and generated per tenant (backends/engine/accounting.py)."""
    m = backend.engine.meter.statistics()
    yield N.ENGINE_BUSY_SECONDS.collected(m.busy_seconds)
    families = [N.ENGINE_GPU_SECONDS.collected(), N.ENGINE_TENANT_COMPUTED.collected(), N.ENGINE_TENANT_GENERATED.collected()]
    for tenant, usage in sorted(m.tenants.items()):
        labels = [tenant, backend.model_name]
        for family, value in zip(families, (usage.gpu_seconds, usage.computed_tokens, usage.generated_tokens), strict=True):
            family.add_metric(labels, value)  # type: ignore[attr-defined]
    yield from families


def _call_timer(backend: EngineBackend, registry: CollectorRegistry) -> CallTimer:
    """Per-call TTFT, inter-token latency and latency by route and model (no
    queue time: the engine's queue is inside it, so it shows in the TTFT)."""
    models = frozenset(backend.info().models)

    def labels(context: RequestContext, call: Call) -> tuple[str, str]:
        return ROUTE_OF_KIND.get(call.kind, N.OTHER), call.model if call.model in models else N.OTHER

    h = [cast(Histogram, f.instrument(registry)) for f in (N.ENGINE_TTFT, N.ENGINE_ITL, N.ENGINE_E2E)]
    return CallTimer(labels, ttft=h[0], itl=h[1], e2e=h[2])


async def run_server(
    backend: EngineBackend,
    options: ServeOptions,
    shutdown: trio.Event | None = None,
    *,
    footprint: Footprint | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the engine loop and serve it over HTTP until ``shutdown`` is set, then
    drain; ``task_status.started`` gets the bound URL."""
    shutdown = trio.Event() if shutdown is None else shutdown
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.run)
        watch = trio.CancelScope()
        nursery.start_soon(_shut_down_when_stopped, backend, shutdown, watch)
        async with trio.open_nursery() as http:
            app = build_app(backend, footprint)
            url = await http.start(functools.partial(serve, app, options, shutdown=shutdown))
            task_status.started(url)
        watch.cancel()
        # serve() returns once in-flight requests drained (or the grace period ran out):
        # only now stop the engine, so draining streams finish their generations.
        await backend.aclose()


async def _shut_down_when_stopped(backend: EngineBackend, shutdown: trio.Event, watch: trio.CancelScope) -> None:
    """An engine that gave up (a dead rank, steps failing in a row) takes its
    server down, so that whoever supervises the process restarts it."""
    with watch:
        await backend.stopped.wait()
        shutdown.set()


# ---------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="headrace engine", description="Serve the built-in torch engine."
    )
    p.add_argument(
        "--model", help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct Q4_1)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200, help="0 picks a free port")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto: bfloat16 where this machine computes it natively or packs 4-bit "
        "weights (CUDA, AVX-512 CPUs), else float32",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-gb", type=float)
    p.add_argument("--kv-idle-gb", type=float,
                   help="KV cache kept resident at idle (prefix cache included; default 64 MiB, "
                        "or all of it where --kv-cache-gb sized it)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-kv-events", action="store_true", help="do not record KV events")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                   help="the same tokens whatever the batch, prefix cache, chunking or resume point "
                        "(--no-batch-invariant: faster kernels chosen by batch size)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--packed-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run GGUF Q4_0/Q4_1 weights packed (4-bit kernel) for small batches in bfloat16",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks (processes; gloo on CPU, NCCL on CUDA)"
    )
    p.add_argument(
        "--generation-config",
        choices=["auto", "off"],
        default="auto",
        help="auto: requests that leave temperature/top_p/top_k/min_p/repetition_penalty "
        "unset get the model's recommended values (its generation config, else the "
        "engine's per-model default); off: OpenAI's defaults (temperature 1)",
    )
    p.add_argument(
        "--sampling-defaults",
        metavar="JSON",
        help='sampling defaults that win over the model\'s, e.g. \'{"temperature": 0.7}\'',
    )
    p.add_argument("--certfile")
    p.add_argument("--keyfile")
    _spec_arguments(p)
    return p


def _spec_arguments(parser: argparse.ArgumentParser) -> None:
    """``--speculative {off,ngram,draft} --num-speculative-tokens K`` and the draft's source."""
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--speculative", choices=["off", "ngram", "draft"], default="off")
    g.add_argument(
        "--num-speculative-tokens", type=int, default=None, metavar="K",
        help="most drafts per request per step (default: 15 for ngram, 4 for draft)",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        help="a cheaper model with the same vocabulary (e.g. a Q4 GGUF)",
    )
    g.add_argument(
        "--draft-layers", type=int, default=None, help="draft with the target's first N layers"
    )
    g.add_argument("--spec-draft-verify", choices=["match", "rejection"], default="match")
    g.add_argument(
        "--spec-max-batch-size", type=int, default=None,
        help="never speculate above this many decoding requests (default: the measured "
        "cost model decides)",
    )


def _spec_config(args: argparse.Namespace) -> SpecConfig:
    try:
        return msgspec.convert(
            {
                "method": args.speculative,
                "num_speculative_tokens": args.num_speculative_tokens,
                "draft_verify": args.spec_draft_verify,
                "max_batch_size": args.spec_max_batch_size,
                "draft_model": args.draft_model,
                "draft_layers": args.draft_layers,
            },
            SpecConfig,
        )
    except msgspec.ValidationError as e:
        raise BadRequest(f"speculative decoding: {e}", param="speculative") from None


def _config(args: argparse.Namespace) -> EngineConfig:
    try:
        return EngineConfig(
            model=args.model,
            dtype=resolve_dtype(args.dtype, args.device),
            device=args.device,
            block_size=args.block_size,
            kv_cache_gb=args.kv_cache_gb,
            kv_idle_gb=args.kv_idle_gb,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
            enable_kv_events=not args.no_kv_events,
            batch_invariant=args.batch_invariant,
            packed_weights=args.packed_weights,
            generation_config=args.generation_config,
            sampling_defaults=_sampling_defaults(args.sampling_defaults),
        )
    except msgspec.ValidationError as exc:
        raise BadRequest(str(exc)) from None


def _sampling_defaults(text: str | None) -> SamplingDefaults | None:
    if text is None:
        return None
    try:
        return msgspec.json.decode(text, type=SamplingDefaults)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"--sampling-defaults: {exc}", param="sampling_defaults") from None


def resolve_dtype(name: str, device: str) -> Literal["float32", "bfloat16"]:
    """``auto``: bfloat16 on CUDA, and on CPUs whose oneDNN has bfloat16 kernels
    (AVX-512 and up: there bfloat16 with packed 4-bit weights decodes ~2x faster than
    float32, bench/README.md); float32 elsewhere."""
    if name == "float32":
        return "float32"
    if name == "bfloat16":
        return "bfloat16"
    import torch

    if resolve_device(device).type == "cuda":
        return "bfloat16"
    fast = bool(torch.backends.mkldnn.is_available()) and bool(  # type: ignore[no-untyped-call]
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    return "bfloat16" if fast else "float32"


class _Shutdown:
    """The bridge from the main thread's signal handler to Trio's drain."""

    def __init__(self) -> None:
        self.token: trio.lowlevel.TrioToken | None = None
        self.event: trio.Event | None = None

    def request(self) -> None:
        if self.token is not None and self.event is not None:
            try:
                self.token.run_sync_soon(self.event.set)
            except trio.RunFinishedError:
                pass


async def _serve(backend: EngineBackend, options: ServeOptions, shutdown: _Shutdown, footprint: Footprint | None = None) -> None:
    shutdown.token, shutdown.event = trio.lowlevel.current_trio_token(), trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(functools.partial(run_server, backend, options, shutdown.event, footprint=footprint))
        print(f"engine serving {backend.model_name} on {url}", flush=True)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.model is None:  # named in /v1/models: the file the tokenizer comes from
        with contextlib.suppress(HeadraceError):  # none installed: _build says so
            args.model = default_model_path()
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    started = time.perf_counter()
    try:
        config, spec = _config(args), _spec_config(args)
        built = _build(config, spec, args.tp)
    except HeadraceError as exc:
        print(f"headrace engine: {exc.message}", file=sys.stderr)
        return 2
    if built is None:  # a torchrun worker rank, stopped by rank 0
        return 0
    engine, tokenizer, name = built
    footprint = measure(engine.runner, time.perf_counter() - started)
    print(f"engine loaded {name} {footprint.line()}", flush=True)
    if hasattr(engine.runner, "memory"):  # what it holds, by layout (runner.MemoryFootprint)
        print(f"engine memory: {engine.runner.memory().line()}", flush=True)
    # Steps run on this (the main) thread, Trio in another: see host.py for why.
    host = MainThreadHost()
    backend = EngineBackend(engine, tokenizer, model_name=name, run_step=host.run_sync)
    options = ServeOptions(
        args.host, args.port, certfile=args.certfile, keyfile=args.keyfile, graceful_timeout=5.0
    )
    shutdown = _Shutdown()
    try:
        host.serve(functools.partial(trio.run, _serve, backend, options, shutdown, footprint), shutdown.request)
    except OSError as exc:
        print(f"headrace engine: cannot serve: {exc}", file=sys.stderr)
        return 1
    finally:
        close = getattr(engine.runner, "close", None)  # tensor-parallel workers
        if close is not None:
            close()
    if backend.stopped.is_set():
        print(f"headrace engine: stopped: {backend.fatal}", file=sys.stderr)
        return 1  # a supervisor (headrace serve's replicas) restarts it
    return 0


def _build(config: EngineConfig, spec: SpecConfig, tp: int) -> tuple[LLMEngine, Tokenizer, str] | None:
    """One process (``tp == 1``) or rank 0 of ``tp`` tensor-parallel ranks."""
    if tp == 1:
        return build_engine(config, spec=spec)
    if tp < 1:
        raise BadRequest("--tp must be at least 1", param="tp")
    if spec.method == "draft" and spec.draft_model is None:
        raise BadRequest("--draft-layers reads the target's layers, which are sharded under --tp; use --draft-model", param="tp")
    launched = launch_tp(config, tp)
    if launched is None:
        return None
    return make_engine(config, launched.runner, launched.tokenizer, spec), launched.tokenizer, launched.name
