"""Log-probs of many token sequences that share prefixes, each shared token run forward once.

Multi-turn agent trajectories of one group share their prompt, trajectories forked from one
state share their earlier turns, and the per-turn training samples of one trajectory are
prefixes of each other. ``PrefixTrie`` merges such sequences into a trie (a node per distinct
(parent, token) pair); ``trie_logprobs`` runs the trie's nodes as one packed row with tree
attention (each token attends exactly to its ancestors and itself, at position = its depth), the
AReaL / Tree-Training layout, so every node's hidden state is the one a separate forward of any
sequence through it computes. A node's output then scores each of its children's tokens, and the
gradient of every sequence's log-probs reaches the parameters through the one shared node.

Forward work drops by ``PrefixTrie.bound`` = tokens / trie tokens, the best speed-up possible
when the cost is per token (attention over the packed row costs more than over a short
sequence, so a long trie gets less than the bound).

Models whose attention cannot take a tree mask exactly (the in-house hybrid's lightning
attention carries a recurrent state along the row; sliding windows; attention implementations
without a custom 4D mask) run every sequence on its own instead, the reason logged once.
"""
from __future__ import annotations

import inspect
import logging
import weakref
from typing import NamedTuple

import torch

from model.logprobs import _fused_hf_head, token_logprobs

log = logging.getLogger("posttrain.trie")


# --------------------------------------------------------------------------- the trie


class PrefixTrie:
    """Token sequences merged into a trie: one node per distinct (parent, token) pair.

    Node ids are DFS preorder (children in first-seen order), so a node's subtree is the id
    range ``[n, n + size[n])`` and ``m`` is an ancestor-or-self of ``n`` exactly when
    ``m <= n < m + size[m]``: the tree-attention mask is that interval test.
    """

    def __init__(self, parent: list[int], token: list[int], paths: list[list[int]]):
        self.parent = parent              # parent node id, -1 at a root
        self.token = token                # the node's token
        self.paths = paths                # node ids of each sequence, position by position
        self.depth = [0] * len(parent)
        self.size = [1] * len(parent)
        for n, p in enumerate(parent):    # parents precede children in preorder
            if p >= 0:
                self.depth[n] = self.depth[p] + 1
        for n in range(len(parent) - 1, -1, -1):
            if parent[n] >= 0:
                self.size[parent[n]] += self.size[n]

    @classmethod
    def build(cls, sequences: list[list[int]]) -> PrefixTrie:
        """The trie of ``sequences`` (each non-empty); duplicates and prefixes add no node."""
        index: dict[tuple[int, int], int] = {}
        children: list[list[int]] = []
        roots: list[int] = []
        tokens: list[int] = []
        raw_paths = []
        for i, seq in enumerate(sequences):
            if len(seq) == 0:
                raise ValueError(f"sequence {i} is empty: every sequence needs at least one token")
            node, path = -1, []
            for tok in seq:
                key = (node, int(tok))
                child = index.get(key)
                if child is None:
                    child = index[key] = len(tokens)
                    tokens.append(int(tok))
                    children.append([])
                    (roots if node < 0 else children[node]).append(child)
                node = child
                path.append(node)
            raw_paths.append(path)
        # renumber in DFS preorder (iterative: a trajectory is thousands of nodes deep)
        new_id = [0] * len(tokens)
        parent = [-1] * len(tokens)
        stack = [(r, -1) for r in reversed(roots)]
        count = 0
        while stack:
            node, par = stack.pop()
            new_id[node], count = count, count + 1
            parent[new_id[node]] = par
            stack.extend((c, new_id[node]) for c in reversed(children[node]))
        token = [0] * len(tokens)
        for old, new in enumerate(new_id):
            token[new] = tokens[old]
        return cls(parent, token, [[new_id[n] for n in path] for path in raw_paths])

    @property
    def num_tokens(self) -> int:
        """Tokens of all sequences together (what separate forwards run)."""
        return sum(len(p) for p in self.paths)

    @property
    def num_nodes(self) -> int:
        """Tokens of the trie (what one tree forward runs)."""
        return len(self.parent)

    @property
    def bound(self) -> float:
        """num_tokens / num_nodes: the forward-work saving, the speed-up bound for per-token cost."""
        return self.num_tokens / max(self.num_nodes, 1)

    def ancestors(self, node: int) -> list[int]:
        """Ancestors of ``node``, root first (not the node itself)."""
        out = []
        while self.parent[node] >= 0:
            node = self.parent[node]
            out.append(node)
        return out[::-1]

    def rows(self, max_tokens: int | None = None) -> list[list[int]]:
        """The node ids of each packed row (ascending, so in DFS order), every row closed under
        ancestors. With no cap, one row holding the whole trie. With a cap, whole root subtrees
        are packed into rows of at most ``max_tokens`` nodes; a subtree too large for a row is
        split below its root, and each row holding part of it repeats the ancestors that part
        attends to (those repeated tokens are the price of the cap)."""
        if max_tokens is None:
            return [list(range(self.num_nodes))]
        longest = max((len(p) for p in self.paths), default=0)
        if max_tokens < longest:
            raise ValueError(f"max_tokens_per_row={max_tokens} is shorter than the longest sequence "
                             f"({longest} tokens): it cannot sit in one row")
        rows: list[list[int]] = []
        row: list[int] = []
        in_row: set[int] = set()
        stack = [n for n in range(self.num_nodes - 1, -1, -1) if self.parent[n] < 0]
        while stack:
            node = stack.pop()
            if self.depth[node] + self.size[node] > max_tokens:   # split: place its children
                stack.extend(c for c in range(node + self.size[node] - 1, node, -1) if self.parent[c] == node)
                continue
            missing = [a for a in self.ancestors(node) if a not in in_row]
            if row and len(row) + len(missing) + self.size[node] > max_tokens:
                rows.append(sorted(row))
                row, in_row = [], set()
                missing = self.ancestors(node)
            unit = missing + list(range(node, node + self.size[node]))
            row += unit
            in_row.update(unit)
        if row:
            rows.append(sorted(row))
        return rows


# --------------------------------------------------------------------------- log-probs


class TrieLogprobs(NamedTuple):
    """Per-sequence results of ``trie_logprobs``.

    ``logp[i][t]`` = log p(seq_i[t+1] | seq_i[:t+1]) in FP32, length len_i - 1, with autograd to
    the model's parameters; ``entropy[i][t]`` the entropy of that next-token distribution.
    ``tokens`` counts the sequences' tokens, ``trie_tokens`` the tokens the forward ran (the
    trie's nodes, plus ancestors repeated across rows; = tokens when separate), ``rows`` the
    forward's rows (or right-padded batches when separate). ``method`` is "tree" or "separate";
    ``reason`` says why the tree was not used (None when it was, or when not asked for it).
    """

    logp: list[torch.Tensor]
    entropy: list[torch.Tensor]
    tokens: int
    trie_tokens: int
    method: str
    reason: str | None
    rows: int


# model -> (attention implementation, None if a tree mask is exact else why not), checked once
_TREE_SUPPORT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MASKED_ATTENTION = ("sdpa", "eager")
_PROBE = ([5, 6, 7, 8], [5, 6, 9, 10, 11], [5, 6, 7], [12, 13])


def trie_logprobs(model, sequences: list[list[int]], *, max_tokens_per_row: int | None = None,
                  tree: bool = True) -> TrieLogprobs:
    """Next-token log-probs and entropies of every sequence, each shared prefix run once.

    Equal to separate forwards of the sequences (``separate_logprobs``) up to float summation
    order, gradients included. ``max_tokens_per_row`` caps a packed row's tokens (rows are
    right-padded into one batch; see ``PrefixTrie.rows``); in the fallback it caps each
    right-padded batch's padded tokens instead. ``tree=False`` runs the sequences separately.
    """
    sequences = [list(map(int, s)) for s in sequences]
    if tree:
        reason = tree_attention_reason(model)
        if reason is None:
            return _tree_logprobs(model, PrefixTrie.build(sequences), max_tokens_per_row)
    else:
        reason = None
    return separate_logprobs(model, sequences, max_tokens_per_batch=max_tokens_per_row, reason=reason)


def tree_attention_reason(model) -> str | None:
    """None when ``model`` can run a packed trie exactly, else why not (each logged once).

    A transformers decoder with ``sdpa`` or ``eager`` attention takes a 4D mask as-is
    (``masking_utils._preprocess_mask_arguments`` returns any 4D mask unchanged, and both
    attention functions add a float mask to the scores), which is what the tree needs; the
    static checks rule out what cannot, and a probe forward (a few tokens, no grad, eval mode)
    confirms the tree reproduces separate forwards on this model.
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    known = _TREE_SUPPORT.get(model)
    if known is not None and known[0] == impl:
        return known[1]
    reason = _static_reason(model, impl)
    if reason is None:
        reason = _probe_reason(model)
    _TREE_SUPPORT[model] = (impl, reason)
    if reason is not None:
        log.warning("tree-attention log-probs off for %s: %s; running every sequence separately",
                    type(model).__name__, reason)
    return reason


def _static_reason(model, impl) -> str | None:
    from transformers import PreTrainedModel

    if hasattr(model, "fused_token_logprobs"):
        return ("the in-house hybrid's lightning (linear) attention carries one recurrent state along "
                "a packed row, so a token would see its siblings' branches: no tree mask applies")
    if not isinstance(model, PreTrainedModel):
        return f"{type(model).__name__} is not a transformers model: no 4D attention-mask path"
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if impl not in _MASKED_ATTENTION:
        return f"attention implementation {impl!r} does not take a custom 4D mask (only {_MASKED_ATTENTION})"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            return f"layers of type {other} (sliding windows, linear attention) would not follow the mask"
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"a sliding window of {config.sliding_window} tokens would not follow the mask"
    params = inspect.signature(model.forward).parameters
    if not {"attention_mask", "position_ids"} <= set(params):
        return "its forward takes no attention_mask and position_ids"
    return None


def _probe_reason(model) -> str | None:
    vocab = model.config.vocab_size
    probe = [[t % vocab for t in seq] for seq in _PROBE]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            tree = _tree_logprobs(model, PrefixTrie.build(probe), None).logp
            alone = [separate_logprobs(model, [seq]).logp[0] for seq in probe]
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:  # rejects the 4D mask or 2D logits_to_keep
        return f"the tree forward failed on a probe: {type(exc).__name__}: {exc}"
    finally:
        model.train(was_training)
    tol = 1e-4 if _param(model).dtype == torch.float32 else 5e-2
    gap = max(float((a - b).abs().max()) for a, b in zip(tree, alone) if a.numel())
    if not gap <= tol:
        return f"a probe's tree log-probs are {gap:.2e} off its separate forwards (> {tol:g})"
    return None


def _param(model) -> torch.Tensor:
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return embed.weight if embed is not None else next(model.parameters())


def tree_inputs(trie: PrefixTrie, rows: list[list[int]], dtype: torch.dtype, device) -> dict:
    """Right-padded rows of trie nodes: input_ids and position_ids (the node's depth) [R, L], and
    the additive 4D mask [R, 1, L, L] in ``dtype``: 0 where a query may attend (its ancestors and
    itself; a padding slot only itself), the dtype's minimum elsewhere (transformers' own
    convention for eager masks; sdpa takes the same float mask)."""
    width = max(len(r) for r in rows)
    node = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, ids in enumerate(rows):
        node[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    real = node >= 0
    safe = node.clamp(min=0)
    token = torch.tensor(trie.token, dtype=torch.long)[safe].masked_fill(~real, 0)
    depth = torch.tensor(trie.depth, dtype=torch.long)[safe].masked_fill(~real, 0)
    size = torch.tensor(trie.size, dtype=torch.long)[safe]
    q, k = node[:, :, None], node[:, None, :]
    allowed = (k <= q) & (q < k + size[:, None, :]) & real[:, None, :] & real[:, :, None]
    allowed |= torch.eye(width, dtype=torch.bool)[None]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return {"input_ids": token.to(device), "position_ids": depth.to(device),
            "attention_mask": mask[:, None].to(device), "node": node}


def _tree_logprobs(model, trie: PrefixTrie, max_tokens_per_row: int | None) -> TrieLogprobs:
    """The tree forward: every edge (parent -> child) scored once, from the parent's output in
    the first row that holds the child (that row holds the parent too)."""
    param = _param(model)
    rows = trie.rows(max_tokens_per_row)
    inputs = tree_inputs(trie, rows, param.dtype, param.device)
    node = inputs.pop("node")
    home_row, home_col = [-1] * trie.num_nodes, [-1] * trie.num_nodes
    for r, ids in enumerate(rows):
        for c, n in enumerate(ids):
            if home_row[n] < 0:
                home_row[n], home_col[n] = r, c
    children = [n for n in range(trie.num_nodes) if trie.parent[n] >= 0]
    col = {(r, n): c for r, ids in enumerate(rows) for c, n in enumerate(ids)}
    edge_row = torch.tensor([home_row[n] for n in children], dtype=torch.long)
    edge_col = torch.tensor([col[home_row[n], trie.parent[n]] for n in children], dtype=torch.long)
    labels = torch.tensor([trie.token[n] for n in children], dtype=torch.long, device=param.device)

    if children:
        logp_e, ent_e = _score_edges(model, inputs, edge_row, edge_col, labels, node.shape)
    else:  # single-token sequences only: nothing to score
        logp_e = ent_e = torch.zeros(0, dtype=torch.float32, device=param.device)
    # index by child node id (roots get an unused 0)
    slot = torch.full((trie.num_nodes,), 0, dtype=torch.long)
    if children:
        slot[torch.tensor(children)] = torch.arange(len(children))
    logp_e = torch.cat([logp_e, logp_e.new_zeros(1)])
    ent_e = torch.cat([ent_e, ent_e.new_zeros(1)])
    slot[[n for n in range(trie.num_nodes) if trie.parent[n] < 0]] = len(children)
    slot = slot.to(param.device)
    logp, entropy = [], []
    for path in trie.paths:
        idx = slot[torch.tensor(path[1:], dtype=torch.long, device=param.device)]
        logp.append(logp_e[idx])
        entropy.append(ent_e[idx])
    return TrieLogprobs(logp, entropy, trie.num_tokens, sum(len(r) for r in rows), "tree", None, len(rows))


def _score_edges(model, inputs: dict, edge_row, edge_col, labels, shape):
    """FP32 (log-prob, entropy) of each edge's child token from its parent's output: through the
    fused FP32 head when the model's lm_head was adopted as one (hidden states of the parents
    only go through the vocabulary), else from the model's own logits at the parent positions
    only (``logits_to_keep`` as a [R, L] boolean mask), log-softmax in FP32."""
    fused = _fused_hf_head(model)
    device = labels.device
    edge_row, edge_col = edge_row.to(device), edge_col.to(device)
    if fused is not None:
        decoder, head = fused
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        return head(hidden[edge_row, edge_col], labels)
    keep = torch.zeros(shape, dtype=torch.bool, device=device)
    keep[edge_row, edge_col] = True
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits   # [kept, V], row-major
    else:
        logits = model(**inputs, use_cache=False).logits[keep]
    position = keep.flatten().cumsum(0) - 1
    kept = position[edge_row * shape[1] + edge_col]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs[kept, labels], entropy[kept]


# --------------------------------------------------------------------------- separate forwards


def padded_batches(lengths: list[int], max_tokens: int | None = None) -> list[list[int]]:
    """Indices of sequences grouped into right-padded batches, longest first: all in one, or
    each batch's rows x longest length at most ``max_tokens`` (a longer sequence alone)."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        width = lengths[batches[-1][0]] if batches else 0
        if batches and (max_tokens is None or (len(batches[-1]) + 1) * width <= max_tokens):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def separate_logprobs(model, sequences: list[list[int]], *, max_tokens_per_batch: int | None = None,
                      reason: str | None = None, pad_id: int = 0) -> TrieLogprobs:
    """Every sequence run on its own (``model.logprobs.token_logprobs``) in right-padded batches:
    one batch, or batches of at most ``max_tokens_per_batch`` padded tokens (longest first; a
    sequence longer than that gets a batch of its own). The reference the tree must equal, and
    the fallback for models that cannot take a tree mask."""
    sequences = [list(map(int, s)) for s in sequences]
    device = _param(model).device
    batches = padded_batches([len(s) for s in sequences], max_tokens_per_batch)
    logp: list[torch.Tensor | None] = [None] * len(sequences)
    entropy: list[torch.Tensor | None] = [None] * len(sequences)
    for batch in batches:
        width = len(sequences[batch[0]])
        if width < 2:
            for i in batch:
                logp[i] = entropy[i] = torch.zeros(0, dtype=torch.float32, device=device)
            continue
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, :len(sequences[i])] = torch.tensor(sequences[i], dtype=torch.long)
            mask[b, :len(sequences[i])] = 1
        lp, ent, _ = token_logprobs(model, ids.to(device), mask.to(device))
        for b, i in enumerate(batch):
            n = len(sequences[i]) - 1
            logp[i], entropy[i] = lp[b, :n], ent[b, :n]
    tokens = sum(len(s) for s in sequences)
    return TrieLogprobs(logp, entropy, tokens, tokens, "separate", reason, len(batches))
