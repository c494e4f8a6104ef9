"""``ddiloco eval --model-file FILE | --synchronizer HOST:PORT [--config FILE]``: held-out loss of a trained model.

The model is built from the config's ``model`` section (the built-in default model without
``--config``), exactly as a learner builds it, and gets its weights from one of two places:

- ``--model-file``: a file written by ``ddiloco export`` (``load_exported``: names and shapes
  checked, and the file's model fingerprint compared with the one this config gives);
- ``--synchronizer``: the live global model, downloaded with FetchState like a joining learner
  does, decoded against the fragment layout this process computes from the model (the
  config's ``protocol.num_fragments``), so a synchronizer running another model or layout is
  refused with what differs. The config's token, token file and TLS files are used, and
  ``$DDILOCO_TOKEN`` as with the learner. A sharded synchronizer: give ``--synchronizer`` once
  per shard.

It then reports the mean cross-entropy over the config's held-out split (``data.load_corpus``,
``eval_batches`` with the config's batch size and ``--batches`` or ``train.eval_batches``),
computed by the learner's own ``evaluate``: the same number a learner logs as ``eval_loss`` for
the same weights. Over FetchState the weights arrive in the synchronizer's global codec; with
``bf16_zstd`` (the default) they are the bf16-rounded model the learners receive, with ``fp32``
they are the synchronizer's master copy bit for bit, i.e. exactly what ``ddiloco export`` writes.

Exit status: 0 evaluated; 2 nothing to evaluate (missing file, weights that do not fit the
model, an unreachable or refusing synchronizer, a bad config), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FETCH_CHUNK_BYTES = 64 * 1024 * 1024
"""Largest chunk accepted from the synchronizer: the protocol's upper bound, so that reading the
live model does not depend on the config repeating the synchronizer's ``max_chunk_bytes``."""


class EvalError(Exception):
    """Nothing can be evaluated; the message says why."""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


# -- weights from an exported file ----------------------------------------------------------------

def _load_file(model: torch.nn.Module, path: str, fingerprint: str, *, ignore_fingerprint: bool) -> dict[str, Any]:
    from ddiloco.training.export_io import ExportLoadError, load_exported, read_export_metadata

    try:
        meta = read_export_metadata(path)
        theirs = meta.get("model_fingerprint")
        if theirs is not None and theirs.startswith("params-"):
            # Trained by an own loop (DecoupledSync): its default identity is the parameters'
            # names, shapes and dtypes plus the model reference it announced, recorded as "model".
            from ddiloco.learner.sync import parameter_fingerprint

            fingerprint = parameter_fingerprint(model, meta.get("model") or "")
        if theirs is not None and theirs != fingerprint and not ignore_fingerprint:
            described = f" ({meta['model']})" if meta.get("model") else ""
            raise EvalError(f"{path} holds weights of model {theirs}{described}, but the config builds {fingerprint}: "
                            "evaluate with the training run's config (--config), or pass --ignore-fingerprint "
                            "to load it when only fields that leave the tensors alone differ")
        meta = load_exported(model, path, strict=True)
    except FileNotFoundError as exc:
        raise EvalError(str(exc)) from None
    except ExportLoadError as exc:
        raise EvalError(str(exc)) from None
    try:
        versions = json.loads(meta.get("fragment_versions") or "{}")
    except json.JSONDecodeError:
        versions = {}
    return {"source": f"file:{path}", "versions": versions, "model": meta.get("model"),
            "layout_hash": meta.get("layout_hash")}


# -- weights from a live synchronizer -------------------------------------------------------------

def _describe_mismatch(ours: Any, theirs: dict[int, tuple[Any, ...]]) -> str:
    """What differs between our layout and the fragments a synchronizer served."""
    parts = []
    ids = sorted(theirs)
    if len(ids) != ours.num_fragments or (ids and ids[-1] >= ours.num_fragments):
        parts.append(f"it serves fragments {ids}, the config has protocol.num_fragments {ours.num_fragments}")
    their_specs = {t.name: t for specs in theirs.values() for t in specs}
    our_specs = {t.name: t for frag in ours for t in frag.tensors}
    only_theirs = sorted(set(their_specs) - set(our_specs))
    only_ours = sorted(set(our_specs) - set(their_specs))
    shapes = [f"{n} {list(their_specs[n].shape)} vs {list(our_specs[n].shape)}" for n in sorted(set(their_specs)
              & set(our_specs)) if their_specs[n].shape != our_specs[n].shape]
    dtypes = [f"{n} {their_specs[n].dtype} vs {our_specs[n].dtype}" for n in sorted(set(their_specs) & set(our_specs))
              if their_specs[n].dtype != our_specs[n].dtype]
    for what, names in (("tensors only the synchronizer has", only_theirs), ("tensors only this model has", only_ours),
                        ("shapes differ (synchronizer vs model)", shapes),
                        ("dtypes differ (synchronizer vs model)", dtypes)):
        if names:
            shown = ", ".join(names[:10]) + (f", ... ({len(names) - 10} more)" if len(names) > 10 else "")
            parts.append(f"{len(names)} {what}: {shown}")
    if not parts:
        parts.append("the same tensors are grouped into fragments differently")
    return "; ".join(parts)


def _specs(tensors: Any) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    return tuple((t.name, tuple(t.shape), t.dtype) for t in tensors)


async def _fetch(targets: list[str], credentials: Any, timeout_s: float) -> list[tuple[str, Any]]:
    from ddiloco.protocol.client import fetch_state

    transfers: list[tuple[str, Any]] = []
    async with asyncio.timeout(timeout_s):
        for target in targets:
            got = await fetch_state(target, max_chunk_bytes=FETCH_CHUNK_BYTES, learner_id=f"eval-{os.getpid()}",
                                    credentials=credentials, timeout_s=timeout_s)
            transfers.extend((target, t) for t in got)
    return transfers


def _load_live(model: torch.nn.Module, targets: list[str], cfg: Any, timeout_s: float) -> dict[str, Any]:
    import grpc

    from ddiloco.fragments.errors import FragmentError
    from ddiloco.fragments.outer_gradient import scatter
    from ddiloco.fragments.partition import partition_tensors
    from ddiloco.fragments.payload import decode_fragment
    from ddiloco.protocol.client import StreamClosed

    params = dict(model.named_parameters())
    try:  # the learner's own layout: the same call on the same parameters (DecoupledSync.__init__)
        layout = partition_tensors(list(params.items()), cfg.protocol.num_fragments)
    except ValueError as exc:
        raise EvalError(f"protocol.num_fragments does not fit the model: {exc}") from None
    where = ", ".join(targets)
    try:
        credentials = cfg.credentials
        transfers = asyncio.run(_fetch(targets, credentials, timeout_s))
    except TimeoutError:
        raise EvalError(f"no answer from the synchronizer at {where} within {timeout_s:g}s (--timeout)") from None
    except StreamClosed as exc:
        code = exc.code
        if code == grpc.StatusCode.UNAVAILABLE:
            why = f"cannot reach the synchronizer at {where}: {exc.details}"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            why = f"no answer from the synchronizer at {where} within {timeout_s:g}s (--timeout)"
        elif code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            why = (f"the synchronizer at {where} refused the credentials ({exc.details}): set the config's "
                   "learner.token_file / tls_* files, --token-file or $DDILOCO_TOKEN")
        elif code == grpc.StatusCode.FAILED_PRECONDITION:
            why = f"the synchronizer at {where} has no global model yet ({exc.details})"
        elif code == grpc.StatusCode.UNIMPLEMENTED:
            why = f"{where} does not serve the ddiloco synchronizer API (another service, or a proxy): {exc.details}"
        else:
            why = f"the synchronizer at {where} refused FetchState: {exc}"
        raise EvalError(why) from None
    except FragmentError as exc:
        raise EvalError(f"broken transfer from {where}: {exc}") from None
    except (OSError, ValueError) as exc:  # unreadable TLS files or token file
        raise EvalError(f"credentials: {exc}") from None
    served: dict[int, Any] = {}
    for target, t in transfers:
        p = t.header.fragment_id
        if p in served:
            raise EvalError(f"fragment {p} is served by both {served[p][0]} and {target}: give each shard once")
        served[p] = (target, t)
    theirs = {p: t.header.tensors for p, (_, t) in served.items()}

    def fits(p: int) -> bool:  # the fragment holds the tensors our layout puts there (names, shapes, dtypes)
        return 0 <= p < layout.num_fragments and _specs(theirs[p]) == _specs(layout[p].tensors)

    # Compared fragment by fragment rather than by the transfers' layout hash: a shard serves only
    # its own fragments (and state dirs of shards made before they recorded the whole model's
    # layout hash announce the hash of their partial layout).
    if not all(fits(p) for p in theirs):
        raise EvalError(f"the synchronizer at {where} holds another model or layout than this config builds "
                        f"({layout.fingerprint}): {_describe_mismatch(layout, theirs)}. Evaluate with the "
                        "training run's config (--config)")
    missing = [p for p in range(layout.num_fragments) if p not in theirs]
    if missing:
        raise EvalError(f"the synchronizer at {where} serves fragments {sorted(theirs)} only; fragments {missing} "
                        "are missing (a sharded synchronizer: pass --synchronizer once per shard)")
    versions, codecs = {}, set()
    for p, (_, t) in sorted(served.items()):
        try:
            values = decode_fragment(t, layout)
        except FragmentError as exc:
            raise EvalError(f"fragment {p} from the synchronizer does not decode: {exc}") from None
        scatter(layout[p], values, params)
        versions[str(p)] = t.header.version
        codecs.add(t.header.codec)
    return {"source": f"synchronizer:{where}", "versions": versions, "codec": ",".join(sorted(codecs)),
            "layout_hash": layout.fingerprint}


# -- the command ----------------------------------------------------------------------------------

def evaluate_weights(cfg: Any, *, model_file: str | None = None, synchronizers: list[str] | None = None,
                     batches: int | None = None, timeout_s: float = 30.0,
                     ignore_fingerprint: bool = False) -> dict[str, Any]:
    """Build the model of ``cfg``, load weights from ``model_file`` or ``synchronizers``, evaluate
    it on the held-out split; the result as a dict (see ``main``). Raises EvalError."""
    from ddiloco.training.data import eval_batches, load_corpus
    from ddiloco.training.inner_loop import evaluate, resolve_device
    from ddiloco.training.model import build_model, model_fingerprint

    if (model_file is None) == (not synchronizers):
        raise EvalError("give either a model file or a synchronizer address")
    try:
        device = resolve_device(cfg.train.device)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    try:
        model = build_model(cfg.model, cfg.train.seed)
    except (ValueError, ImportError, OSError) as exc:  # e.g. a model reference that does not import
        raise EvalError(f"cannot build the model: {exc}") from None
    fingerprint = model_fingerprint(model, cfg.model)
    if model_file is not None:
        loaded = _load_file(model, model_file, fingerprint, ignore_fingerprint=ignore_fingerprint)
    else:
        loaded = _load_live(model, list(synchronizers or ()), cfg, timeout_s)
    n = batches or cfg.train.eval_batches
    try:
        corpus = load_corpus(cfg.data)
        held_out = eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.context, n)
    except ValueError as exc:
        raise EvalError(f"data: {exc}") from None
    model.to(device)
    loss = evaluate(model, held_out, device)
    return {"loss": loss, "batches": len(held_out), "tokens": sum(int(y.numel()) for _, y in held_out),
            "corpus": corpus.name, "model_fingerprint": fingerprint, **loaded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddiloco eval", description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Exit status: 0 evaluated; 2 nothing evaluated (the reason is on stderr).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-file", metavar="FILE.safetensors", help="weights written by ddiloco export")
    source.add_argument("--synchronizer", action="append", metavar="HOST:PORT",
                        help="the live global model of this synchronizer (a sharded one: once per shard, or "
                             "HOST:PORT,HOST:PORT,..., or a {shard} pattern with --shards)")
    parser.add_argument("--shards", type=_positive, help="synchronizer shards a {shard} pattern expands to")
    parser.add_argument("--config", help="the run's YAML/JSON config (model, data, train, protocol, credentials); "
                                         "default: the built-in defaults")
    parser.add_argument("--batches", type=_positive, help="held-out batches (default: the config's train.eval_batches)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line of text")
    parser.add_argument("--timeout", type=_positive_float, default=30.0, metavar="S",
                        help="longest wait for the synchronizer, in seconds (default 30)")
    parser.add_argument("--token-file", dest="token_file",
                        help="file holding the bearer token (default: the config's token_file, else $DDILOCO_TOKEN)")
    parser.add_argument("--threads", type=_positive, help="torch threads (default: the config's train.threads)")
    parser.add_argument("--ignore-fingerprint", action="store_true",
                        help="load a model file whose model fingerprint differs from the config's "
                             "(names and shapes are still checked)")
    args = parser.parse_args(argv)

    from ddiloco.core.logs import configure

    configure()  # logs (e.g. a corpus cache being built) go to stderr; stdout carries the result
    from ddiloco.core.resources import available_cpus
    from ddiloco.learner.config import load_learner_config
    from ddiloco.protocol.credentials import TOKEN_ENV
    from ddiloco.protocol.shards import synchronizer_targets

    def fail(message: str) -> int:
        print(f"ddiloco eval: {message}", file=sys.stderr)
        return 2

    try:
        cfg = load_learner_config(args.config, synchronizer=(args.synchronizer or [None])[0],
                                  token_file=args.token_file)
        if cfg.token is None and cfg.token_file is None and os.environ.get(TOKEN_ENV):
            cfg = dataclasses.replace(cfg, token=os.environ[TOKEN_ENV])
    except ValueError as exc:
        return fail(str(exc))
    if args.synchronizer:
        try:  # each value one address, a list or a pattern: one address per shard in all
            args.synchronizer = [t for spec in args.synchronizer
                                 for t in synchronizer_targets(spec, args.shards if "{shard}" in spec else None)]
        except ValueError as exc:
            return fail(str(exc))
    import torch

    torch.set_num_threads(args.threads or cfg.train.threads or available_cpus())
    try:
        result = evaluate_weights(cfg, model_file=args.model_file, synchronizers=args.synchronizer,
                                  batches=args.batches, timeout_s=args.timeout,
                                  ignore_fingerprint=args.ignore_fingerprint)
    except EvalError as exc:
        return fail(str(exc))
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        versions = list(result["versions"].values())
        span = f", fragment versions {min(versions)}..{max(versions)}" if versions else ""
        print(f"eval loss {result['loss']:.6f} over {result['batches']} held-out batches ({result['tokens']:,} "
              f"tokens of {result['corpus']}); weights from {result['source']}{span}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
