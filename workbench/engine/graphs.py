"""One-token decode steps with fixed shapes, replayed as CUDA graphs between the host points.

A decode step launches ~50 kernels per layer; at batch 1 the GPU finishes each in a few µs, so the
host's launch and Python time, not the GPU, set the tokens/s. ``DecodeStep`` cuts a step into
pieces with fixed shapes and addresses (token and position live in device tensors, the KV cache is
written with ``index_copy_`` and attended in full under a mask) and captures each run of accelerator
pieces as one CUDA graph. The host points are the hybrid MoE layers (experts on the CPU or
streamed): there a step (1) replays the graph that ends with the router and the copies of the
routing into pinned memory, (2) records an event, (3) replays the graph of the resident experts and
shared expert, (4) waits for the event and computes the CPU / streamed experts while (3) runs, adding
their result to (3)'s output in place, then goes on with the next graph. A layer whose experts are
all resident is just part of a graph: a model all on the GPU is one graph per token.

With a decode server (``served.DecodeServer``, the default on CUDA: ``engine.served_mode``) the
hybrid layers it supports need no host point: their CPU experts are served by a native thread
through page-locked memory, and a step whose hybrid layers are all served is one CUDA graph.

On a CPU accelerator (tests) the same pieces run eagerly (``capture=False``).
"""

from __future__ import annotations

import logging

import torch

from . import cpu_kernel, gpu_kernels, served
from .model import STEP_MASKS, rms_norm
from .moe import MoeBlock
from .packed import embedding, linear

log = logging.getLogger(__name__)


def _plain_norm(weight: torch.Tensor | None, like: torch.Tensor) -> bool:
    """Whether ``weight`` is a plain RMS norm weight ``[H]`` in the activations' dtype (what the fused
    add + norm kernel takes)."""
    return weight is not None and weight.dim() == 1 and weight.shape[0] == like.shape[-1] and weight.dtype == like.dtype


class DecodeStep:
    """Runs ``engine``'s one-token forward pass from fixed buffers; with ``capture`` as CUDA graphs,
    captured on the first call (which runs eagerly and returns its own result)."""

    def __init__(self, engine, capture: bool):
        self.e = engine
        self.capture = capture
        dev = engine.device
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.env: dict = {}
        self.unserved: str | None = None  # why hybrid layers went without the decode server (None: they did not)
        self.server = self._server()
        self.pieces = self._pieces()
        self.schedule: list | None = None  # after capture: ("graph", g) / ("record", experts) / ("host", fn)

    def _server(self) -> served.DecodeServer | None:
        """A decode server for the hybrid layers it supports (``engine.served_mode``: ``auto`` on CUDA
        with the Triton kernels, ``on`` also on a CPU accelerator, ``off`` never)."""
        e = self.e
        mode, cuda = getattr(e, "served_mode", "auto"), e.device.type == "cuda"
        if mode == "off" or (mode == "auto" and not cuda):
            return None
        if cuda and (not gpu_kernels.available() or served.globaltimer is None):
            return None
        layers = [lx for lx in e.experts.values() if served.supports(lx)]
        if not layers or not cpu_kernel.available():
            return None
        try:
            return served.DecodeServer(e.device, layers, e.args.top_k, e.args.hidden, served.server_threads())
        except Exception as exc:  # noqa: BLE001 - the host-driven steps still work
            log.warning("decode server unavailable, hybrid layers wait on the host: %s", exc)
            self.unserved = f"{type(exc).__name__}: {exc}"
            return None

    def close(self) -> None:
        """Stop the decode server's thread, if any (the engine drops this step afterwards)."""
        if self.server is not None:
            self.server.close()
            self.server = None

    def _unserve(self, why: str) -> None:
        """Go on without the decode server: host-driven hybrid layers, graphs captured again."""
        log.warning("decode steps go on without the decode server: %s", why)
        self.unserved = why
        self.close()
        self.pieces = self._pieces()
        self.schedule = None

    # -- the pieces of a step --------------------------------------------------------------------

    def _pieces(self) -> list[tuple[str, object]]:
        """The step as pieces. Each residual add and the RMS norm after it are one kernel where the
        norms allow (``gpu_kernels.add_rms_norm``): ``env["x"]`` is the residual stream and
        ``env["xn"]`` its norm for the next layer's attention (or for the head)."""
        e, env = self.e, self.env
        layers = e.layers
        norms = [(layer.attn_norm, layer.eps) for layer in layers[1:]] + [(e.norm, e.args.rms_eps)]
        like = torch.empty(e.args.hidden, dtype=e.dtype, device=e.device)  # the activations
        fused = gpu_kernels.usable(like) and all(
            _plain_norm(w, like) for layer in layers for w in (layer.attn_norm, layer.ffn_norm)) and \
            _plain_norm(e.norm, like)

        def kernels() -> bool:  # off once a kernel failed here (``_eager``)
            return fused and gpu_kernels.available()

        def add_norm(a, b, w, eps):
            if kernels():
                return gpu_kernels.add_rms_norm(a, b, w, eps)
            s = a + b
            return s, rms_norm(s, w, eps)

        def attend(layer):  # the attention half: (residual stream, its norm for the MoE block)
            then = (env["x"], layer.ffn_norm, layer.eps) if kernels() else None
            a = layer.attn(env["xn"], self.pos, None, e.rope, then)
            return a if isinstance(a, tuple) else add_norm(env["x"], a, layer.ffn_norm, layer.eps)

        pieces: list[tuple[str, object]] = []

        srv = self.server

        def embed():
            if srv is not None:
                srv.begin()
            env["x"] = embedding(self.token, e.embed)
            env["xn"] = rms_norm(env["x"], layers[0].attn_norm, layers[0].eps)

        pieces.append(("dev", embed))
        for i, layer in enumerate(layers):
            ffn = layer.ffn
            after = norms[i]  # the norm of what follows this layer
            if not (isinstance(ffn, MoeBlock) and ffn.experts.needs_host):
                def whole(layer=layer, after=after):
                    h, hn = attend(layer)
                    env["x"], env["xn"] = add_norm(h, layer.ffn(hn), *after)

                pieces.append(("dev", whole))
                continue
            lx = ffn.experts
            if srv is not None and lx.layer in srv.layers and not ffn.scale_input:
                def served_layer(layer=layer, ffn=ffn, lx=lx, after=after):
                    h, hn = attend(layer)
                    ids, w = ffn.route(hn)
                    srv.publish(lx, hn, ids, w)
                    bus_y = srv.start_bus(lx, hn, w)
                    out = lx.device_part(hn, ids, w, False, ffn.extra(hn), masked=True)
                    srv.join_bus(bus_y, out)
                    srv.wait_add(lx, out)
                    env["x"], env["xn"] = add_norm(h, out, *after)

                pieces.append(("dev", served_layer))
                continue

            def route(layer=layer, ffn=ffn, i=i):
                h, hn = attend(layer)
                ids, w = ffn.route(hn)
                env[i] = {"h": h, "hn": hn, "ids": ids, "w": w, "host": ffn.experts.stage(hn, ids, w, record=False)}

            def device(ffn=ffn, i=i):
                s = env[i]
                s["out"] = ffn.experts.device_part(s["hn"], s["ids"], s["w"], ffn.scale_input, ffn.extra(s["hn"]))

            def host(ffn=ffn, i=i):
                s = env[i]
                ffn.experts.staging.wait()
                ffn.experts.host_part(s["hn"], s["ids"], s["w"], s["host"], s["out"], ffn.scale_input)

            def combine(i=i, after=after):
                env["x"], env["xn"] = add_norm(env[i]["h"], env[i]["out"], *after)

            pieces += [("dev", route), ("record", lx), ("dev", device), ("host", host), ("dev", combine)]

        def head():
            env["logits"] = linear(env["xn"], e.lm_head).float()

        pieces.append(("dev", head))
        return pieces

    # -- running ---------------------------------------------------------------------------------

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        """Logits ``[1, vocab]`` (float32) of ``token`` at position ``pos``; writes that KV position."""
        try:
            logits = self._step(token, pos)
            if self.server is not None:
                self.server.check()
            return logits
        except served.ServedError as exc:
            self._unserve(str(exc))
            return self._step(token, pos)  # rewrites the same KV position

    def _step(self, token: int, pos: int) -> torch.Tensor:
        if self.server is not None:
            self.server.wake()  # after a prompt or a pause it waits on a condition, not polling
        self.token.fill_(token)
        self.pos.fill_(pos)
        if self.schedule is not None:
            for kind, obj in self.schedule:
                if kind == "graph":
                    obj.replay()
                elif kind == "record":
                    obj.staging.record()
                else:
                    obj()
            return self.env["logits"].clone()
        if not self.capture:
            self._eager()
            return self.env["logits"].clone()
        side = torch.cuda.Stream(self.e.device)  # the first step runs eagerly on the capture stream
        side.wait_stream(torch.cuda.current_stream(self.e.device))
        with torch.cuda.stream(side):
            self._eager()
            logits = self.env["logits"].clone()
        torch.cuda.current_stream(self.e.device).wait_stream(side)
        try:
            self._capture(side)
        except served.ServedError as exc:  # the next step captures without the server
            self._unserve(str(exc))
        except (RuntimeError, AssertionError) as exc:  # an op that cannot be captured: run eagerly from now on
            log.warning("decode steps run without CUDA graphs: capture failed (%s)", str(exc).splitlines()[0][:200])
            self.capture = False
        return logits

    def _eager(self) -> None:
        """Run the pieces eagerly; a Triton kernel that does not build or run here turns the kernels
        off for the process and the step runs again on the PyTorch paths (rewriting its KV position)."""
        try:
            self._eager_once()
        except Exception as exc:
            if not (gpu_kernels.available() and gpu_kernels.failed_here(exc)):
                raise
            gpu_kernels.disable(f"{type(exc).__name__}: {exc}")
            if self.server is not None and self.e.device.type == "cuda":
                self._unserve("the Triton kernels are off")
            self._eager_once()

    def _eager_once(self) -> None:
        self.e.rope._memo = None  # RoPE tables are memoised per position tensor, and this one is reused
        STEP_MASKS.clear()
        for kind, obj in self.pieces:
            if kind == "record":
                obj.staging.record()
            else:
                obj()

    def _capture(self, stream) -> None:
        """Capture each run of accelerator pieces as one graph (all in one memory pool, replayed in
        capture order); record and host pieces stay eager."""
        self.e.rope._memo = None  # the tables' gather must be part of the first graph
        STEP_MASKS.clear()  # so must the masks
        pool = torch.cuda.graph_pool_handle()
        schedule: list = []
        run: list = []

        def flush():
            if run:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    for fn in run:
                        fn()
                schedule.append(("graph", g))
                run.clear()

        for kind, obj in self.pieces:
            if kind == "dev":
                run.append(obj)
            else:
                flush()
                schedule.append((kind, obj))
        flush()
        self.memo = (self.e.rope._memo, dict(STEP_MASKS))  # keeps the captured tables and masks alive
        STEP_MASKS.clear()
        self.schedule = schedule
        log.info("decode step captured as %d CUDA graphs", sum(k == "graph" for k, _ in schedule))
