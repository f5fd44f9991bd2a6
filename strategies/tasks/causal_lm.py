"""Causal LM: a pretrained Hugging Face model fine-tuned by every node on its own text domain.

``task.name = "causal_lm"``. The model is a Hugging Face folder (``config.json``, safetensors
weights, ``tokenizer.json``) loaded by :mod:`strategies.models` (Llama, Mistral, Qwen2,
GPT-2, SmolLM2), or a known name such as ``"smollm2"`` resolved to its cache folder by
``strategies.models.hub`` (``meta-consensus models fetch smollm2``). The text is tokenized with
the folder's ``tokenizer.json`` (the ``tokenizers`` package; no network, no transformers) into
windows of ``context + 1`` tokens: inputs ``x = w[:-1]``, next-token targets ``y = w[1:]``.

Domains (:mod:`strategies.tasks.lm_corpus`): ``text`` is files, globs or JSONL files with a
``"text"`` field; a list is one domain per entry, a table ``{domain = [globs]}`` names them;
by default the standard library's module families of :mod:`strategies.tasks.text` are the
(code) domains. Non-IID by domain: node i fine-tunes on domain ``i % D``, on documents no other
node has; the general pool (public), held-out and test windows come from documents of their own
roles, an equal share of windows from every domain. Every batch carries each row's
``"domain"``, and the metrics are given overall and per domain (``perplexity/<domain>``, ...).

Every node starts from the checkpoint: :meth:`CausalLMTask.init` returns the pretrained
float32 params whatever its key (their tree follows Hugging Face's module names,
``model/layers/0/self_attn/q_proj/kernel``, so LoRA targets are PEFT's names).

Multi-host: a process tokenizes the documents of the nodes it hosts and the shared pools only.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from strategies.tasks import lm_corpus
from strategies.tasks.base import TASKS, Array, Batch, PyTree, TaskData, hosted_nodes, masked_mean
from strategies.tasks.checks import TaskError
from strategies.tasks.text import assign_files

#: Logits per chunk of an evaluation batch (rows x tokens x vocab): 2^25 float32 logits is
#: 128 MiB, a few rows of SmolLM2's 49,152-token vocabulary at context 128.
METRICS_LOGITS = 2**25
#: The most rows per chunk (a small vocabulary).
METRICS_MAX_ROWS = 32


def _str_keys(tree: Any) -> Any:
    """Integer dict keys (layer indices) as decimal strings, as checkpoints and safetensors want."""
    if isinstance(tree, Mapping):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def resolve_model(model: str) -> Path:
    """The model folder of the ``model`` option: a folder, or a known name in the model cache.

    Args:
      model: a Hugging Face folder, or a name ``strategies.models.hub`` knows ("smollm2").

    Returns:
      The folder.

    Raises:
      TaskError: a path that is not a folder, or a name the hub does not know or has not fetched.
    """
    if not isinstance(model, str) or not model.strip():
        raise TaskError(f"model must be a model folder or a known model name, got {model!r}")
    path = Path(model).expanduser()
    if path.is_dir():
        return path.absolute()
    if os.sep in model or "/" in model or path.exists():
        raise TaskError(f"model {model!r} is not a folder (a Hugging Face folder with config.json)")
    try:
        from strategies.models import hub
    except ImportError:
        raise TaskError(f"model {model!r} is not a folder, and this install knows no model names") from None
    try:
        return Path(hub.resolve(model)).absolute()
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise TaskError(f"model {model!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class CausalLMTask:
    """Next-token prediction with a pretrained causal LM, non-IID by text domain.

    The model and tokenizer are loaded (and the documents listed) when the task is built, so a
    bad folder, tokenizer or text option fails here, before any run starts.

    Args:
      model: a Hugging Face folder, or a known model name (``"smollm2"``).
      text: the domains (see the module docstring); None: the standard library's families.
      context: tokens per example (at most the model's ``max_position_embeddings``).
      windows_per_node: training windows drawn from each node's own documents.
      general_windows: windows in the shared general (public) pool, split over the domains.
      heldout_windows: windows in the held-out pool, split over the domains.
      test_windows: windows in the test pool, split over the domains.
      max_bytes_per_doc: only the first this many bytes of each document are used.
      split_seed: seed of the document roles and of the shared pools.
      remat: recompute each block's activations in the backward pass (less memory).

    Raises:
      TaskError: for a bad option, model folder, tokenizer or text (one line naming it).
    """

    model: str = "smollm2"
    text: lm_corpus.Domains | None = None
    context: int = 128
    windows_per_node: int = 256
    general_windows: int = 256
    heldout_windows: int = 64
    test_windows: int = 64
    max_bytes_per_doc: int = 32_768
    split_seed: int = 0
    remat: bool = False
    name: str = "causal_lm"
    kind: ClassVar[str] = "language"  # the weight objectives may not assume per-class logits
    # The general pool is windows of documents whose role is "general", never a node's.
    general_pool: ClassVar[str] = "public"
    # Every node starts from a checkpoint: the run reports the base model's metrics too.
    pretrained: ClassVar[bool] = True
    # Every projection is a strategies.models Linear: LoRA runs beside the frozen kernels (LowRankKernel).
    low_rank_kernels: ClassVar[bool] = True
    # loss, metrics and target_probs read the model through self.apply only (strategies.tangent)
    linearizable: ClassVar[bool] = True

    def __post_init__(self):
        object.__setattr__(self, "text", lm_corpus.normalize_domains(self.text))
        for field in ("context", "windows_per_node", "general_windows", "heldout_windows", "test_windows"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TaskError(f"{field} must be an integer >= 1, got {value!r}")
        if self.max_bytes_per_doc < 1:
            raise TaskError(f"max_bytes_per_doc must be >= 1, got {self.max_bytes_per_doc}")
        folder = resolve_model(self.model)
        tokenizer_file = folder / "tokenizer.json"
        if not (folder / "config.json").is_file():
            raise TaskError(f"model folder {folder} has no config.json (is it a Hugging Face model folder?)")
        if not tokenizer_file.is_file():
            raise TaskError(
                f"model folder {folder} has no tokenizer.json (the task tokenizes with it; "
                "save one with tokenizer.save_pretrained)"
            )
        import strategies.models as models

        try:
            lm, params = models.load(folder, dtype=jnp.float32, remat=bool(self.remat))
        except models.ModelError as e:
            raise TaskError(f"model {self.model!r}: {e}") from None
        limit = int(lm.config.max_position_embeddings)
        if self.context > limit:
            raise TaskError(
                f"context={self.context} is longer than the model's max_position_embeddings={limit}"
            )
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the tokenizers package's own exception type
            raise TaskError(f"{tokenizer_file} cannot be read: {str(e).splitlines()[0]}") from None
        names, docs = lm_corpus.list_documents(
            self.text, max_bytes=self.max_bytes_per_doc, split_seed=self.split_seed
        )
        for field in ("general_windows", "heldout_windows", "test_windows"):
            if getattr(self, field) < len(names):
                raise TaskError(
                    f"{field}={getattr(self, field)} is fewer than the {len(names)} domains (every domain "
                    "needs windows in every shared pool)"
                )
        eos = lm.hf_config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        private = {
            "folder": folder,
            "lm": lm,
            "params": _str_keys(params),
            "axes": _str_keys(lm.logical_axes()),
            "tokenizer": tokenizer,
            "eos": int(eos) if isinstance(eos, int) and 0 <= eos < lm.config.vocab_size else None,
            "domains": names,
            "docs": docs,
        }
        object.__setattr__(self, "_loaded", private)

    # ------------------------------------------------------------------ what was loaded

    def _get(self, key: str) -> Any:
        # What __post_init__ loaded (model, params, tokenizer, documents): no dataclass field, so
        # it takes no part in the task's equality and hash.
        return self.__dict__["_loaded"][key]

    @property
    def folder(self) -> Path:
        """The model folder the task loaded."""
        return self._get("folder")

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size."""
        return int(self._get("lm").config.vocab_size)

    @property
    def domains(self) -> tuple[str, ...]:
        """The domain names, in order (node i's domain is ``domains[i % D]``)."""
        return self._get("domains")

    @property
    def documents(self) -> tuple[lm_corpus.Document, ...]:
        """Every document of the corpus with its domain and role."""
        return self._get("docs")

    @property
    def tokenizer(self) -> Any:
        """The model folder's ``tokenizers.Tokenizer``."""
        return self._get("tokenizer")

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends every document in a stream (config.json's ``eos_token_id``), or None."""
        return self._get("eos")

    def record(self) -> dict[str, Any]:
        """What a run records about the task for export: the model folder, the domains, the options.

        Returns:
          A JSON-safe dict.
        """
        lm = self._get("lm")
        return {
            "task": self.name,
            "model": self.model,
            "model_folder": str(self.folder),
            "model_type": lm.config.family,
            "context": self.context,
            "domains": list(self.domains),
            "text": None if self.text is None else {d: list(p) for d, p in self.text},
            "options": {
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name not in ("text", "name", "model")
            },
        }

    # ------------------------------------------------------------------ model

    def init(self, key: Array) -> PyTree:
        """The pretrained float32 params (every node starts from the checkpoint).

        Args:
          key: unused.

        Returns:
          The params (a nested dict; layer indices as string keys).
        """
        del key
        return self._get("params")

    def logical_axes(self, params: PyTree | None = None) -> PyTree:
        """Logical axis names of every parameter dimension (the model's).

        Args:
          params: unused.

        Returns:
          A tree like the params with a tuple of names per leaf.
        """
        return self._get("axes")

    def apply(self, params: PyTree, inputs: Array, *, train: bool = False, key: Array | None = None) -> Array:
        """Next-token logits (B, T, vocab) in the params' dtype.

        Args:
          params: the parameters.
          inputs: (B, T) int tokens, T <= context.
          train: unused (the models have no dropout).
          key: unused.

        Returns:
          The logits.

        Raises:
          ValueError: for more than ``context`` tokens.
        """
        if inputs.shape[-1] > self.context:
            raise ValueError(f"inputs have {inputs.shape[-1]} tokens, more than context={self.context}")
        return self._get("lm").apply(params, inputs)

    def _token_nll(self, params: PyTree, x: Array, y: Array) -> tuple[Array, Array]:
        logits = self.apply(params, x)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, y[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return nll, logits

    def loss(self, params: PyTree, batch: Batch, key: Array | None = None) -> Array:
        """Mean next-token cross entropy in nats (float32) over the tokens of the valid rows.

        Args:
          params: the parameters.
          batch: ``{"x", "y"}`` token arrays (``"mask"`` and ``"domain"`` optional).
          key: unused.

        Returns:
          A float32 scalar.
        """
        nll, _ = self._token_nll(params, batch["x"], batch["y"])
        mask = batch.get("mask")
        return masked_mean(nll, None if mask is None else jnp.broadcast_to(mask[:, None], nll.shape))

    def chunk_rows(self) -> int:
        """Rows per chunk of an evaluation batch (about :data:`METRICS_LOGITS` logits each).

        Returns:
          The row count, in [1, :data:`METRICS_MAX_ROWS`].
        """
        return max(1, min(METRICS_MAX_ROWS, METRICS_LOGITS // (self.context * self.vocab_size)))

    def _chunks(self, batch: Batch, fn: Any) -> Any:
        """``fn(x, y, row_mask)`` over the batch in chunks of :meth:`chunk_rows` rows (``lax.map``).

        The full-vocabulary logits of a whole evaluation set never exist at once; padded rows of
        the last chunk are masked out. Returns fn's outputs with the chunks' rows concatenated.
        """
        x, y = batch["x"], batch["y"]
        rows, per = x.shape[0], min(self.chunk_rows(), x.shape[0])
        pad = -rows % per
        mask = batch.get("mask")
        mask = jnp.ones((rows,), jnp.float32) if mask is None else mask.astype(jnp.float32)

        def chunks(v: Array) -> Array:
            v = jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1))
            return v.reshape((-1, per) + v.shape[1:])

        out = jax.lax.map(lambda c: fn(*c), (chunks(x), chunks(y), chunks(mask)))
        return jax.tree.map(lambda v: v.reshape((-1,) + v.shape[2:])[:rows], out)

    def metrics(self, params: PyTree, batch: Batch) -> dict[str, Array]:
        """Loss (nats per token), perplexity and top-1 accuracy, overall and per domain.

        Math:
          loss = mean over the valid tokens of -log p(y_t | x_<=t); perplexity = exp(loss).
          ``loss/<d>``, ``perplexity/<d>`` and ``accuracy/<d>`` are the same over the rows
          whose ``batch["domain"]`` is d (NaN for a domain without rows); without a
          ``"domain"`` array only the overall metrics are given.

        Computed :meth:`chunk_rows` rows at a time: the sums of the token losses, of the correct
        tokens and of the tokens are accumulated per row, so the result is the masked mean of
        the whole batch as in one pass.

        Args:
          params: the parameters.
          batch: ``{"x", "y"}`` token arrays, ``"domain"`` (rows,) int and ``"mask"`` optional.

        Returns:
          The metrics, float32 scalars.
        """

        def per_row(x: Array, y: Array, m: Array) -> Array:
            nll, logits = self._token_nll(params, x, y)
            correct = (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
            tokens = jnp.float32(x.shape[1])
            return jnp.stack([jnp.sum(nll, -1) * m, jnp.sum(correct, -1) * m, tokens * m], -1)

        sums = self._chunks(batch, per_row)  # (rows, 3)
        out = _summary(jnp.sum(sums, axis=0))
        domain = batch.get("domain")
        if domain is not None:
            onehot = jax.nn.one_hot(domain, len(self.domains), dtype=jnp.float32)  # (rows, D)
            by_domain = onehot.T @ sums  # (D, 3)
            for d, name in enumerate(self.domains):
                for k, v in _summary(by_domain[d]).items():
                    out[f"{k}/{name}"] = jnp.where(by_domain[d, 2] > 0, v, jnp.float32(jnp.nan))
        return out

    def target_probs(self, params: PyTree, batch: Batch) -> Array:
        """p(y_t | x_<=t) of every target token, flattened: (rows * T,) float32, chunked as :meth:`metrics`.

        What the ``mixture_nll`` weight objective mixes: the logits of a whole held-out set
        never exist at once.

        Args:
          params: the parameters.
          batch: ``{"x", "y"}`` token arrays.

        Returns:
          The probabilities.
        """

        def probs(x: Array, y: Array, m: Array) -> Array:
            nll, _ = self._token_nll(params, x, y)
            return jnp.exp(-nll)

        return self._chunks({"x": batch["x"], "y": batch["y"]}, probs).reshape(-1)

    def flip_labels(self, batch: Batch) -> Batch:
        """Label flipping on tokens: y -> vocab - 1 - y.

        Args:
          batch: a batch with targets ``"y"``.

        Returns:
          The batch with flipped targets (same dtype).
        """
        out = dict(batch)
        out["y"] = (self.vocab_size - 1 - batch["y"]).astype(batch["y"].dtype)
        return out

    # ------------------------------------------------------------------ data

    def _pool(self, doc_ids: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
        """The token stream of documents ``doc_ids`` and where each starts; checked against the vocab."""
        docs = self.documents
        texts = [lm_corpus.read_document(docs[j], self.max_bytes_per_doc) for j in doc_ids]
        stream, starts = lm_corpus.token_stream(self.tokenizer, texts, self.eos_token_id)
        if len(stream) < self.context + 1:
            raise TaskError(
                f"{what}: its documents hold {len(stream)} tokens, fewer than context + 1 = "
                f"{self.context + 1}; add text or lower task.options.context"
            )
        if stream.size and int(stream.max()) >= self.vocab_size:
            raise TaskError(
                f"tokenizer.json gives token {int(stream.max())}, outside the model's "
                f"vocab_size={self.vocab_size}"
            )
        return stream, starts

    def splits(
        self,
        num_nodes: int,
        *,
        seed: int = 0,
        alpha: float = 0.5,
        process_index: int = 0,
        process_count: int = 1,
    ) -> TaskData:
        """Per-node windows of the node's own documents, and the shared general / held-out / test pools.

        Args:
          num_nodes: n over all processes; node i's domain is ``i % D``.
          seed: seed of the node windows (node i draws from ``default_rng([seed, i])``).
          alpha: unused: the split is non-IID by domain, not by a Dirichlet draw.
          process_index: this process's index; it reads the documents of its hosted nodes only.
          process_count: the number of processes.

        Returns:
          TaskData with batches ``{"x", "y": (.., context) int32, "domain": (..,) int32}``; groups
          are the domains. ``meta`` holds ``example_ids`` / ``general_ids`` (document << 32 |
          token offset of each window's first token), ``node_docs`` (document indices of each
          hosted node), ``documents`` (their names), ``domains`` and ``model_folder``.

        Raises:
          TaskError: a domain with fewer private documents than nodes, or a pool with fewer
            tokens than one window.
        """
        del alpha
        docs, names = self.documents, self.domains
        num_domains = len(names)
        hosted = hosted_nodes(num_nodes, process_index, process_count)
        for d, name in enumerate(names):
            nodes = len(range(d, num_nodes, num_domains))
            private = sum(doc.domain == d and doc.role == "private" for doc in docs)
            if private < nodes:
                raise TaskError(
                    f"text: domain {name!r} has {private} private documents for its {nodes} nodes "
                    f"(num_nodes={num_nodes}); every node needs one: add documents or use fewer nodes"
                )
        node_docs = assign_files(docs, num_nodes, num_domains)  # type: ignore[arg-type]  # same fields
        length = self.context + 1

        def shared_pool(role: str, count: int, offset: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
            rng = np.random.default_rng([self.split_seed, 1 + offset])
            per = [count // num_domains + (d < count % num_domains) for d in range(num_domains)]
            windows, ids, domain = [], [], []
            for d in range(num_domains):
                members = np.array([j for j, doc in enumerate(docs) if doc.domain == d and doc.role == role])
                stream, starts = self._pool(members, f"the {role} documents of domain {names[d]!r}")
                w, off = lm_corpus.stream_windows(stream, per[d], length, rng)
                windows.append(w)
                ids.append(lm_corpus.window_ids(off, starts, members))
                domain.append(np.full((per[d],), d, np.int32))
            w, dom = np.concatenate(windows), np.concatenate(domain)
            return {"x": w[:, :-1], "y": w[:, 1:], "domain": dom}, np.concatenate(ids)

        general, general_ids = shared_pool("general", self.general_windows, 0)
        heldout, _ = shared_pool("heldout", self.heldout_windows, 1)
        test, _ = shared_pool("test", self.test_windows, 2)

        xs, ys, ids = [], [], []
        for node in hosted:
            rng = np.random.default_rng([seed, int(node)])
            members = np.asarray(node_docs[node], np.int64)
            stream, starts = self._pool(members, f"node {int(node)} (domain {names[node % num_domains]!r})")
            w, off = lm_corpus.stream_windows(stream, self.windows_per_node, length, rng)
            xs.append(w[:, :-1])
            ys.append(w[:, 1:])
            ids.append(lm_corpus.window_ids(off, starts, members))
        n_local, m = len(hosted), self.windows_per_node
        node_domain = (hosted % num_domains).astype(np.int32)
        node_groups = np.zeros((n_local, num_domains), bool)
        node_groups[np.arange(n_local), node_domain] = True
        return TaskData(
            num_nodes=num_nodes,
            node_ids=hosted,
            train={
                "x": np.stack(xs),
                "y": np.stack(ys),
                "domain": np.broadcast_to(node_domain[:, None], (n_local, m)).copy(),
            },
            train_count=np.full((n_local,), m, np.int32),
            train_groups=np.broadcast_to(node_domain[:, None], (n_local, m)).astype(np.int32),
            general=general,
            general_groups=general["domain"].copy(),
            heldout=heldout,
            test=test,
            node_groups=node_groups,
            group_names=names,
            process_index=process_index,
            process_count=process_count,
            meta={
                "example_ids": np.stack(ids).astype(np.int64),
                "general_ids": general_ids.astype(np.int64),
                "general_pool": "public",
                "node_docs": [np.asarray(node_docs[i], np.int64) for i in hosted],
                "documents": tuple(d.name for d in docs),
                "domains": names,
                "model_folder": str(self.folder),
                "seed": seed,
            },
        )


def _summary(sums: Array) -> dict[str, Array]:
    """loss, perplexity and accuracy from (sum of token NLL, correct tokens, tokens)."""
    count = jnp.maximum(sums[2], jnp.float32(1.0))
    loss = sums[0] / count
    return {"loss": loss, "perplexity": jnp.exp(loss), "accuracy": sums[1] / count}


@TASKS.declare("causal_lm")
def causal_lm(
    model: str = "smollm2",
    text: Any = None,
    context: int = 128,
    windows_per_node: int = 256,
    general_windows: int = 256,
    heldout_windows: int = 64,
    test_windows: int = 64,
    max_bytes_per_doc: int = 32_768,
    split_seed: int = 0,
    remat: bool = False,
) -> CausalLMTask:
    """A pretrained Hugging Face causal LM fine-tuned on text domains."""
    return CausalLMTask(
        model=model,
        text=lm_corpus.normalize_domains(text),
        context=context,
        windows_per_node=windows_per_node,
        general_windows=general_windows,
        heldout_windows=heldout_windows,
        test_windows=test_windows,
        max_bytes_per_doc=max_bytes_per_doc,
        split_seed=split_seed,
        remat=remat,
    )
