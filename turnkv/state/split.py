"""The stored form shared by load, partial, Krul and MiniCache, and its two-stream restore.

Layer l keeps the K/V of its tokens at positions >= starts[l] (loaded) and recomputes the rest from the
token history; starts never increases with depth. Pairs (i, j), i > j, keep their loaded part merged
(MiniCache) over layer i's loaded rows. Tensors: the layout's (positions, masses when informative);
k.{l}/v.{l} per unpaired layer as stored (quantized codes with k_scale.{l}/v_scale.{l}, restored bit
for bit); per pair, in the compute dtype, {i}.{j}.{dir_k, dir_v, mag_k_i, mag_k_j, mag_v_i, mag_v_j,
idx_k, idx_v, ret_k_i, ret_k_j, ret_v_i, ret_v_j}. Restore: layer l waits only for layer l's copies.
Design: docs/state.md#the-stored-form-and-the-two-stream-restore"""

from __future__ import annotations

import torch

from turnkv.kv.snapshot import (Layout, all_slots, export_rows, get_stored_rows, layout_of, put_stored_rows, reserve_for,
                                stored_rows)
from turnkv.kv.token_slots import token_runs
from turnkv.state import merge
from turnkv.state.prefix import PrefixStep, recompute_prefix
from turnkv.state.streams import LoadStream


def _same_tokens(layout: Layout, i: int, j: int) -> bool:
    if not (layout.lengths[i] == layout.lengths[j]).all():
        return False
    pi, pj = layout.positions[i], layout.positions[j]
    return (pi is None and pj is None) or (pi is not None and pj is not None and torch.equal(pi, pj))


def pack_split(seq, starts: list[int], pairs: list[tuple[int, int]] = (), tau: float = 0.6,
               retain_threshold: float = 0.05, max_retained: float = 0.05, clock=None,
               on_host: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of the split form. Pairs whose layers hold different tokens (uneven eviction)
    cannot share rows; they are stored unmerged and listed under meta["unmergeable"]. clock: times
    the export (rows out of the pages) and the merge apart, as clock.lap(key). on_host: move each
    layer's rows to host memory as it is exported, so the GPU stages one layer, not the whole state
    (slower: for an offload that must free GPU memory when little is left)."""
    lap = clock.lap if clock is not None else (lambda key: None)
    flat = all_slots(seq)
    layout, slots = layout_of(seq, flat), flat[0]
    tensors = layout.tensors()
    merged, unmergeable = [], []
    for i, j in pairs:
        (merged if _same_tokens(layout, i, j) else unmergeable).append((i, j))
    paired = {layer for pair in merged for layer in pair}
    retained = {}
    for layer in range(seq.pool.num_layers):
        if layer not in paired:
            rows = stored_rows(seq, layer, starts[layer], slots[layer])
            put_stored_rows(tensors, layer, {k: t.cpu() for k, t in rows.items()} if on_host else rows)
    lap("export_s")
    for i, j in merged:
        ki, vi = export_rows(seq, i, starts[i], slots[i])
        kj, vj = export_rows(seq, j, starts[i], slots[j])  # the pair's direction covers layer i's longer loaded part
        lap("export_s")
        name = f"{i}.{j}"
        for kind, xi, xj in (("k", ki, kj), ("v", vi, vj)):
            m = merge.merge_rows(xi, xj, tau, retain_threshold, max_retained)
            tensors.update({f"{name}.dir_{kind}": m["dir"], f"{name}.mag_{kind}_i": m["mag_i"],
                            f"{name}.mag_{kind}_j": m["mag_j"], f"{name}.idx_{kind}": m["idx"],
                            f"{name}.ret_{kind}_i": m["ret_i"], f"{name}.ret_{kind}_j": m["ret_j"]})
            retained[f"{name}.{kind}"] = int(m["idx"].numel())
        lap("merge_s")
    meta = {**layout.meta(), "starts": [int(s) for s in starts], "pairs": [list(p) for p in merged],
            "unmergeable": [list(p) for p in unmergeable], "retained": retained}
    return meta, tensors


def restore_split(ctx, seq, tokens: list[int], meta: dict, tensors: dict[str, torch.Tensor],
                  load: bool = True, recompute: bool = True, gate: bool = True) -> LoadStream:
    """Rebuild the KV into the empty `seq`; returns the load stream (its copies may still be in flight).
    With `gate`, the next forward's layers wait for their own layer's copies (hooks that fire once);
    without, the caller waits (stream.wait_all()). load / recompute False skip one stream, to time the
    other alone (calibration, overlap checks)."""
    layout = Layout.from_stored(meta, tensors)
    starts = meta["starts"]
    if any(b > a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"stored recompute lengths must not increase with depth: {starts}")
    if layout.next_position > len(tokens):
        raise ValueError(f"the stored state covers {layout.next_position} tokens and the history has {len(tokens)}")
    if layout.is_contiguous() and all(m is None for m in layout.masses):
        stream = _restore_contiguous(ctx, seq, tokens, meta, tensors, layout.next_position, load, recompute)
    else:
        stream = _restore_general(ctx, seq, tokens, meta, tensors, layout, load, recompute)
    if gate:
        stream.gate(ctx.model)
    return stream


def _restore_contiguous(ctx, seq, tokens, meta, tensors, n: int, load: bool, recompute: bool) -> LoadStream:
    """Every head holds 0..n-1: layer l's stored rows are, per head, positions [starts[l], n) in
    (head, token) order, and its slots are a view of one reserve. Nothing here waits for the device."""
    starts, pairs = meta["starts"], [tuple(p) for p in meta["pairs"]]
    pool = seq.pool
    H, D, dtype = pool.num_kv_heads, pool.head_dim, pool.dtype
    slots = seq.reserve(n) if n else torch.zeros(pool.num_layers, H, 0, dtype=torch.int64, device=pool.device)
    seq.moves += 1  # written behind the page statistics' back, as reserve_layout marks a restore
    # Flat slot lists made now, on the current stream, which the load stream waits for (start()).
    rec_slots = [slots[layer, :, :s].transpose(0, 1).reshape(-1) for layer, s in enumerate(starts)]  # token-major
    load_slots = [slots[layer, :, s:].reshape(-1) for layer, s in enumerate(starts)]  # (head, token)
    stream = LoadStream(pool.device)
    stream.start()
    partner = {j: i for i, j in pairs}
    deeper = set(partner.values())
    for layer in range(pool.num_layers if load else 0):
        if layer in deeper:
            continue  # loaded with its shallower partner
        if layer not in partner:
            rows = get_stored_rows(tensors, layer)

            def work(layer=layer, rows=rows):
                pool.write(layer, load_slots[layer], **{kind: stream.to_device(t) for kind, t in rows.items()})

            # The slots were made on the current stream and are read on the load stream: kept alive
            # until the copies are done, so the allocator cannot hand their memory out meanwhile.
            stream.run(layer, work, *rows.values(), load_slots[layer])
            continue
        i, j = partner[layer], layer
        name = f"{i}.{j}"
        pair = {key: tensors[f"{name}.{key}"] for key in PAIR_KEYS}

        def work(i=i, j=j, pair=pair):
            d = {key: stream.to_device(t) for key, t in pair.items()}
            rows = n - starts[i]  # per head: the pair's rows are layer i's loaded positions
            skip = starts[j] - starts[i]  # layer j recomputes the first `skip` of them
            rebuilt = {}
            for kind in ("k", "v"):
                direction, idx = d[f"dir_{kind}"], d[f"idx_{kind}"].long()
                for layer_, side in ((i, "i"), (j, "j")):
                    # direction * |x| in one kernel, computed in fp32 and stored in the pool dtype
                    x = torch.empty(direction.shape, dtype=dtype, device=direction.device)
                    torch.mul(direction, d[f"mag_{kind}_{side}"][:, None], out=x)
                    x.index_copy_(0, idx, d[f"ret_{kind}_{side}"].to(dtype))  # outliers, originals
                    if layer_ == j and skip:
                        x = x.view(H, rows, D)[:, skip:].reshape(-1, D)
                    rebuilt[layer_, kind] = x
            for layer_ in (i, j):  # (quantized by a quantized pool)
                pool.write(layer_, load_slots[layer_], rebuilt[layer_, "k"], rebuilt[layer_, "v"])

        stream.run(j, work, *pair.values(), load_slots[i], load_slots[j])
        if stream.cuda:
            stream.events[i] = stream.events[j]
    if recompute:
        step = PrefixStep(pool, rec_slots, None, None)
        recompute_prefix(ctx.model, tokens, list(starts), step)
    return stream


PAIR_KEYS = ("dir_k", "dir_v", "mag_k_i", "mag_k_j", "mag_v_i", "mag_v_j", "idx_k", "idx_v",
             "ret_k_i", "ret_k_j", "ret_v_i", "ret_v_j")


def _restore_general(ctx, seq, tokens, meta, tensors, layout: Layout, load: bool, recompute: bool) -> LoadStream:
    """Any layout (uneven heads, positions with gaps, H2O masses)."""
    starts, pairs = meta["starts"], [tuple(p) for p in meta["pairs"]]
    pool, device = seq.pool, seq.pool.device
    slots = reserve_for(seq, layout)
    rec_slots, rec_heads, rec_rows, load_slots, positions = [], [], [], [], []
    for layer, s in enumerate(slots):
        pos = layout.layer_positions(layer, device)
        if starts[layer] <= 0:  # every row loaded: no mask to read back (the load strategy's case)
            none = s[:0]
            rec_slots.append(none)
            rec_heads.append(none)
            rec_rows.append(none)
            load_slots.append(s)
            positions.append(pos)
            continue
        heads = token_runs(layout.lengths[layer], device)[0]
        recomputed = pos < starts[layer]
        rec_slots.append(s[recomputed])
        rec_heads.append(heads[recomputed])
        rec_rows.append(pos[recomputed])
        load_slots.append(s[~recomputed])
        positions.append(pos)

    # Everything the load stream reads that the current stream computes is made before start().
    pair_rows = {}
    for i, j in pairs:
        region = positions[i][positions[i] >= starts[i]]  # layer i's loaded rows = the pair's rows
        pair_rows[j] = region >= starts[j]  # layer j's loaded rows among them
    stream = LoadStream(device)
    stream.start()
    partner = {j: i for i, j in pairs}
    deeper = set(partner.values())
    dtype = pool.dtype
    for layer in range(pool.num_layers if load else 0):
        if layer in deeper:
            continue  # loaded with its shallower partner
        if layer in partner:
            i, j = partner[layer], layer
            name = f"{i}.{j}"
            pair_tensors = {key[len(name) + 1:]: t for key, t in tensors.items() if key.startswith(name + ".")}
            j_rows = pair_rows[j]

            def work(i=i, j=j, p=pair_tensors, j_rows=j_rows):
                d = {key: stream.to_device(t) for key, t in p.items()}
                for kind in ("k", "v"):
                    xi = merge.restore_rows(d[f"dir_{kind}"], d[f"mag_{kind}_i"], d[f"idx_{kind}"], d[f"ret_{kind}_i"])
                    xj = merge.restore_rows(d[f"dir_{kind}"], d[f"mag_{kind}_j"], d[f"idx_{kind}"], d[f"ret_{kind}_j"])
                    if kind == "k":
                        ki, kj = xi, xj[j_rows]
                    else:
                        pool.write(i, load_slots[i], ki.to(dtype), xi.to(dtype))
                        pool.write(j, load_slots[j], kj.to(dtype), xj[j_rows].to(dtype))

            stream.run(j, work, *pair_tensors.values(), load_slots[i], load_slots[j], j_rows)
            if stream.cuda:
                stream.events[i] = stream.events[j]
        else:
            rows = get_stored_rows(tensors, layer)

            def work(layer=layer, rows=rows):
                pool.write(layer, load_slots[layer], **{kind: stream.to_device(t) for kind, t in rows.items()})

            stream.run(layer, work, *rows.values(), load_slots[layer])
    if recompute:
        recompute_prefix(ctx.model, tokens, list(starts), PrefixStep(pool, rec_slots, rec_heads, rec_rows))
    return stream
