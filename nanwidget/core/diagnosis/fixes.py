"""The known fixes for each kind of diagnosis, in the user's words (the likeliest first).

Each function returns the suggestion list of one kind, filled in with what the diagnosis knows
(the module, the op's line, the dtype, the batch). The texts are reviewed fixes from the
PyTorch documentation and the usual answers to these bugs; they name real APIs only.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..stats import dtype_max

__all__ = ["overflow", "scaled_gradient_overflow", "divergence", "domain", "masked_row", "corrupted_weight", "bad_data",
           "loss", "loss_input", "unknown", "in_wrapper_terms", "FABRIC_TERMS",
           "LIGHTNING_TERMS", "LIGHTNING_MANUAL_TERMS",
           "SKORCH_TERMS", "SB3_TERMS", "TIMM_TERMS", "SB3_WHOLE_FIXES", "TRAINER_TERMS", "TRAINER_WHOLE_FIXES",
           "ST_TRAINER_WHOLE_FIXES", "ST_FIT_TERMS", "ST_FIT_WHOLE_FIXES",
           "LIGHTNING_WHOLE_FIXES", "NAME_THE_LOSS_OP", "in_full_precision",
           "in_dp_terms", "with_one_cycle", "without_watch_callback"]

_LOW_PRECISION = ("float16", "bfloat16")


_EXPONENTIALS = ("exp", "exp2", "expm1", "sinh", "cosh")
# Sums into an index (a graph's aggregation over a node's neighbours, a pool over a graph's
# nodes, an embedding bag): they overflow by adding many moderate values, not by a large one.
_INDEXED_SUMS = ("scatter_add", "scatter_add_", "index_add", "index_add_", "scatter_reduce",
                 "scatter_reduce_", "index_reduce", "index_reduce_", "segment_reduce",
                 "_segment_reduce", "embedding_bag", "_embedding_bag")
# A layer's own product of inputs and weights (nn.Linear, nn.Conv*), as the trace names it.
_LAYERS = ("linear", "addmm", "_addmm_activation", "addmv", "convolution", "_convolution",
           "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
           "conv_transpose3d", "mkldnn_convolution", "cudnn_convolution",
           "_slow_conv2d_forward", "slow_conv3d_forward", "mkldnn_linear")
# Products of two activations: attention scores are the usual one.
_PRODUCTS = ("bmm", "baddbmm", "matmul", "mm", "einsum", "_scaled_dot_product_attention_math",
             "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention")
_NORMALISATIONS = ("native_group_norm", "native_layer_norm", "native_batch_norm",
                   "native_batch_norm_legit", "native_batch_norm_legit_no_training",
                   "batch_norm_with_update", "batch_norm_no_update")


def overflow(module: str, dtype: str, at: str, op: str,
             tiny_denominator: bool = False, hint: str = "", policy_dtype: str = "") -> list[str]:
    """``hint``: "log-scale" when the exponent is a predicted log-scale (a flow's coupling or
    autoregressive layer, a Gaussian head's log-std or log-variance). ``policy_dtype``: the
    dtype FSDP2's MixedPrecisionPolicy casts the parameters to ("" when none does): the fix
    for float16 then changes the policy, not torch.autocast."""
    where = f"module '{module}'" if module else "that part of the model"
    fixes = []
    if hint == "softmax" and op in _EXPONENTIALS:
        # A softmax by hand: exp(x - max) / sum is the same value and never passes 1.
        fixes.append(f"Subtract each row's max before {op}{at}: e = torch.exp(x - x.amax(dim, "
                     "keepdim=True)); e / e.sum(dim, keepdim=True) is the same softmax and its "
                     "exp never passes 1. Or call torch.softmax(x, dim) (torch.logsumexp for "
                     "the log of the sum), which does this.")
    if hint == "log-scale" and op in _EXPONENTIALS:
        # What flows do (RealNVP, Glow, nflows, zuko): a soft clamp keeps the gradient alive.
        fixes.append(f"Bound the predicted log-scale softly before {op}{at}: s = c * "
                     "torch.tanh(s / c) with c = 2 to 5, as affine coupling and "
                     "autoregressive flows do (Glow: scale = torch.sigmoid(s + 2)); for a "
                     "Gaussian's log-std or log-variance, clamp it (log_var.clamp(-10, 10)) "
                     "or predict the scale as F.softplus(raw) + 1e-4. The exp and the "
                     "log-determinant (the sum of s) then stay finite.")
    if tiny_denominator:  # the numerators are moderate: the denominator is what to fix
        fixes.append(f"Keep the denominator{at} away from 0: x / d.clamp_min(eps). A learned "
                     "temperature gets a floor, t.clamp_min(0.01) or 0.01 + F.softplus(t) "
                     "(CLIP learns its inverse, logit_scale, and clamps it at 100); a norm or a "
                     "std gets an eps, x / (x.norm(dim=-1, keepdim=True) + eps).")
        if dtype == "float16":
            fixes.append(f"Run {where} in bfloat16 or float32: float16 passes 65504 as soon "
                         "as a value of 1 is divided by less than 1.5e-5.")
        return fixes
    if dtype == "float16" and policy_dtype == "float16":
        fixes.append(f"Run {where} in bfloat16 (same range as float32) or float32: FSDP2's "
                     "MixedPrecisionPolicy(param_dtype=torch.float16) casts it to float16; "
                     "give fully_shard mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                     "reduce_dtype=torch.float32), or shard that module on its own in float32 "
                     "first: fully_shard(module, mp_policy=MixedPrecisionPolicy("
                     "param_dtype=torch.float32)).")
    elif dtype == "float16":
        fixes.append(f"Run {where} in bfloat16 (same range as float32) or float32: under "
                     "torch.autocast, wrap it in torch.autocast(device_type, enabled=False) and "
                     "pass it x.float(); or autocast with dtype=torch.bfloat16.")
    if op in _EXPONENTIALS:
        # exp(x) overflows from x = log(largest) (11.1, 88.7, 709.8): a clamp stays below,
        # with room for what multiplies the result.
        bound = {"float16": 10, "float64": 700}.get(dtype, 80)
        fixes.append(f"Clamp the exponent{at} below log of {dtype or 'the dtype'}'s largest: "
                     f"torch.{op}(x.clamp(max={bound})); a learnable scale or temperature "
                     "(CLIP's logit_scale.exp()) is clamped the same way, "
                     "logit_scale.clamp(max=math.log(100)).exp().")
    if op in ("exp", "pow", "sum", "mean", "cumsum", "prod") \
            and hint not in ("log-scale", "softmax"):
        fixes.append(f"Use a stable form for {op}{at}: torch.logsumexp / softmax instead of exp "
                     "by hand, subtract the max first, or sum in float32 (dtype=torch.float32).")
    if dtype.startswith("float8"):  # its range is a few hundred (e4m3) to 57344 (e5m2)
        return fixes + _float8_overflow(dtype, at, op)
    if op in _INDEXED_SUMS:
        fixes.append(f"{op}{at} sums the values that share an index (a node's messages from its "
                     "neighbours, a graph's nodes in a pool): a slot that gathers many overflows "
                     "though each value is moderate. Accumulate in float32 (src.float(), then cast "
                     "back), or average instead of summing (scatter_reduce(..., reduce='mean'); "
                     "in PyTorch Geometric aggr='mean' or global_mean_pool).")
    elif op not in _EXPONENTIALS:
        clamp = 'x.clamp(-6e4, 6e4)' if dtype == 'float16' else 'x.clamp(-1e4, 1e4)'
        if op in _LAYERS:  # a layer's product of its inputs and weights
            fixes.append(f"Keep the values smaller before {op}{at}: normalise the layer's "
                         "inputs (a LayerNorm or BatchNorm before it), keep its weights small "
                         f"(weight decay, a lower learning rate), or clamp them ({clamp}).")
        else:
            scaled = " (attention scores divided by sqrt(d))" if op in _PRODUCTS else ""
            fixes.append(f"Keep the values smaller before {op}{at}: scale them{scaled}, "
                         f"normalise the inputs, or clamp them ({clamp}).")
    if dtype not in _LOW_PRECISION:
        limit = dtype_max(dtype or "float32")
        largest = f"{dtype} value past {limit:.2g}".replace("e+", "e") if math.isfinite(limit) \
            else "float32 value past 3.4e38"
        fixes.append(f"A {largest} means runaway growth: look for a missing "
                     "normalisation, an input on the wrong scale, or weights that grew (see "
                     "the history: w.history()).")
    return fixes


def learned_log_scale(name: str) -> list[str]:
    """The fix of an exp that overflowed on a learned log-scale (CLIP's logit_scale)."""
    parts = name.split(".")
    held = (f"model.{name}" if all(p.isidentifier() for p in parts)
            else f"model.get_parameter('{name}')")
    return [f"Keep the learned '{name}' in range, as CLIP does: after each optimizer step, "
            f"with torch.no_grad(): {held}.clamp_(0, math.log(100)) (its exp then stays at "
            f"most 100); in a forward of your own, clamp it where it is used: "
            f"{parts[-1]}.clamp(max=math.log(100)).exp()."]


def _float8_overflow(dtype: str, at: str, op: str) -> list[str]:
    """A float8 format's own limits: values are scaled into them before the cast, as float8
    training recipes do, or clamped to its largest (past it: NaN, or inf in float8_e5m2)."""
    largest = f"{dtype_max(dtype):g}"
    return [f"Scale the values into {dtype}'s range before {op}{at}, as float8 recipes do: "
            f"scale = x.abs().amax() / {largest} (per tensor, or per row with "
            "amax(dim=-1, keepdim=True)), cast (x / scale).to(torch." + dtype + ") and "
            "multiply by scale after casting back (torch._scaled_mm takes such scales).",
            f"Or clamp to {dtype}'s largest before the cast: x.clamp(-{largest}, {largest}) "
            "saturates the values past it instead of losing them."]


def weight_gradient_overflow(module: str, dtype: str, received: float | None = None,
                             inputs: float | None = None, bias: bool = False,
                             policy_dtype: str = "") -> list[str]:
    """A parameter's gradient overflowed while the gradient its module received stayed finite.
    ``received``: that gradient's abs max; ``inputs``: the module's inputs' abs max in the
    forward (None: not known); ``bias``: the parameter adds to the output (its gradient sums
    what the module received, whatever its inputs). ``policy_dtype``: the dtype FSDP2's
    MixedPrecisionPolicy casts the parameters to ("" when none does): float16 is then the
    policy's, changed there, not with torch.autocast or a GradScaler."""
    where = f"module '{module}'" if module else "the model"
    # The larger factor of input x gradient is the one to shrink.
    from_the_loss = received is not None and (bias or (inputs is not None and received > inputs))
    mean = ("If the loss sums over the batch (reduction='sum'), reduce it with a mean over the "
            "batch instead (or divide it by the batch size), so the gradients do not grow with "
            "the batch.")
    fixes = []
    if from_the_loss:
        small = f", its inputs only {inputs:.3g}" if inputs is not None else ""
        fixes.append(f"Scale down the gradient {where} receives (abs max {received:.3g}{small}): "
                     "it comes from the loss (through the modules after it), so the loss or its "
                     f"targets are likely on too large a scale for {dtype}. Normalise the "
                     "regression targets (for value targets or returns, scale the rewards down "
                     "or divide them by a running std of the returns), or multiply the loss by "
                     "a smaller factor.")
    else:
        fixes.append(f"Normalise the inputs of {where}: a weight's gradient grows with the "
                     "scale of what the module receives, summed over the batch.")
    if dtype == "float16" and policy_dtype == "float16":
        fixes.append(f"Or run {where} in bfloat16 (float32's range) or float32: FSDP2's "
                     "MixedPrecisionPolicy(param_dtype=torch.float16) computes its gradients in "
                     "float16; give fully_shard mp_policy=MixedPrecisionPolicy(param_dtype="
                     "torch.bfloat16, reduce_dtype=torch.float32), or shard that module on its "
                     "own in float32 first: fully_shard(module, mp_policy=MixedPrecisionPolicy("
                     "param_dtype=torch.float32)).")
        return fixes + [mean]
    if dtype in _LOW_PRECISION:
        fixes.append(f"Or run {where} in float32 (or the whole model in bfloat16, float32's "
                     "range): its gradients then fit. Under torch.autocast, wrap it in "
                     "torch.autocast(device_type, enabled=False) and pass it x.float().")
    fixes.append(mean)
    if dtype in _LOW_PRECISION:
        fixes.append("Under AMP, let torch.amp.GradScaler manage the loss scale (it skips a step "
                     "whose gradients overflowed and lowers the scale), or train in bfloat16.")
    return fixes


def scaled_gradient_overflow(*, batch: int, scale: float, module: str, at_output: bool,
                             output_near_limit: str, stepped_before: bool,
                             op_known: bool, loss_scale_optimizer: str = "") -> list[str]:
    """A GradScaler lowered its scale step after step and the float16 gradients still
    overflowed: the model's values or the loss's gradient are too large for float16.
    ``loss_scale_optimizer``: the name of the optimizer that scaled its loss itself (Keras'
    ``LossScaleOptimizer``, under a ``mixed_float16`` policy), whose user sets precision by
    policy and layer dtype, not with torch.autocast; "" for a GradScaler."""
    keras_words = bool(loss_scale_optimizer)
    if keras_words:
        fixes = ["Train in bfloat16 instead of float16: keras.mixed_precision."
                 "set_global_policy('mixed_bfloat16') has float32's range, so gradients this "
                 f"large fit, and it needs no {loss_scale_optimizer}."]
        in_float32 = "give that layer dtype='float32' (it then computes in float32)"
        last_in_float32 = "give the last layer dtype='float32'"
    else:
        fixes = ["Autocast in bfloat16 instead of float16: torch.autocast(device_type, "
                 "dtype=torch.bfloat16) has float32's range, so gradients this large fit, and "
                 "it needs no GradScaler."]
        in_float32 = ("wrap it in torch.autocast(device_type, enabled=False) and pass it "
                      "x.float()")
        last_in_float32 = ("run the last layer in float32 (wrap it in "
                           "torch.autocast(device_type, enabled=False) and pass it x.float())")
    if output_near_limit:
        fixes.append(f"The model's output itself nearly overflows float16 ({output_near_limit}): "
                     f"normalise before the last layer (a LayerNorm), or {last_in_float32}.")
    if at_output:
        fixes.append("Make the loss's gradient smaller: reduce the loss with a mean over the "
                     "batch and elements (reduction='mean', not 'sum'), normalise the targets, "
                     "and compute the loss in float32 (output.float()).")
    else:
        where = f"module '{module}'" if module else "the module whose gradient overflows"
        if not op_known:
            fixes.append(f"Find the op whose gradient overflows: replay the batch with its "
                         f"backward at that scale, w.replay({batch}, loss_fn=lambda out: "
                         f"criterion(out, targets) * {scale:g}).report().")
        fixes.append(f"Run {where} in float32: {in_float32}.")
    if stepped_before:
        clip = ("clip them: give the optimizer clipnorm=1.0 (or global_clipnorm=1.0)"
                if keras_words
                else "clip them before the step (scaler.unscale_(optimizer), then "
                     "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))")
        fixes.append(f"The gradients grew after training had run: lower the learning rate, or "
                     f"{clip}.")
    return fixes


def compounded(module: str, gradual: bool = False) -> list[str]:
    """An overflow built up over repeated calls of one module within a forward; ``gradual``:
    over many calls, each little above the last (an adaptive solver's small steps through a
    solution that itself grows out of range)."""
    if gradual:
        return [f"'{module}' climbed a little at each of many calls: the solution itself grew "
                "out of range, which smaller steps or tighter tolerances cannot change (an "
                "adaptive solver such as torchdiffeq's dopri5 already shrinks its steps). Keep "
                "the learned vector field bounded (a tanh on its output, "
                "torch.nn.utils.parametrizations.spectral_norm on its layers, weight decay), "
                "integrate over a shorter time span, or rescale the state.",
                "A recurrent cell or an unrolled loop: clip or normalise the state between steps "
                "(a LayerNorm, or h.clamp(-c, c)), use a gated cell (nn.LSTMCell, nn.GRUCell)."]
    return [f"If '{module}' runs in a loop on its own results, bound the step rather than one "
            "op: the values compounded over its calls. An ODE solver: a smaller step, or an "
            "adaptive solver with tolerances (torchdiffeq's odeint(func, y0, t, "
            "method='dopri5', rtol=1e-5, atol=1e-6) shrinks its steps where the solution grows), "
            "an implicit method for stiff dynamics; keep the learned vector field bounded (a "
            "tanh on its output, torch.nn.utils.parametrizations.spectral_norm on its layers).",
            "A recurrent cell or an unrolled loop: clip or normalise the state between steps "
            "(a LayerNorm, or h.clamp(-c, c)), use a gated cell (nn.LSTMCell, nn.GRUCell), and "
            "initialise the recurrent weights orthogonal (nn.init.orthogonal_) so that a step "
            "does not scale the state up."]


_LOWER_LR = ("Lower the learning rate (try 10x lower) or warm it up over the first steps "
             "(torch.optim.lr_scheduler.LinearLR, or OneCycleLR).")


def with_one_cycle(suggestion: list[str], max_lr: float, lr: float) -> list[str]:
    """``suggestion`` for a loop whose optimizer a ``torch.optim.lr_scheduler.OneCycleLR``
    drives: the learning rate to lower is its ``max_lr`` (the step's ``lr``, the schedule's
    own, is set anew at each step), and it warms up already."""
    fix = (f"Lower OneCycleLR's max_lr (try 10x lower: it is {max_lr:.4g}; its schedule had "
           f"the learning rate at {lr:.4g} when training diverged), or climb to it more "
           "slowly: a larger pct_start (0.3 by default: the share of total_steps spent "
           "climbing) or div_factor (25 by default: it starts at max_lr / div_factor).")
    return [fix if text == _LOWER_LR else text for text in suggestion]


def divergence(dtype: str) -> list[str]:
    fixes = [_LOWER_LR,
             "Clip the gradients before the step: "
             "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0).",
             "Under AMP, let torch.amp.GradScaler manage the loss scale (it lowers the scale when "
             "gradients overflow); a fixed large scale diverges."]
    if dtype in _LOW_PRECISION:
        fixes.append("Keep the weights and optimizer state in float32 (autocast the forward "
                     "instead of model.half()).")
    fixes.append("Watch the trend before the next try: w.history() or the FrameBrowser's plot "
                 "shows which module grows first.")
    return fixes


def lbfgs(lr: Any, max_iter: Any, line_search_fn: Any, dtype: str = "") -> list[str]:
    """The fixes of an LBFGS step whose iterations (calls of its closure inside one step())
    moved the weights into NaN/Inf: its own options, not a scheduler's or clipping's."""
    lr = f"{lr:g}" if isinstance(lr, float) else lr
    fixes = []
    if not line_search_fn:
        fixes.append("Give LBFGS a line search: torch.optim.LBFGS(params, lr=..., "
                     "line_search_fn='strong_wolfe'); each iteration then takes a step length "
                     "that lowers the loss, where without one every iteration after the first "
                     f"moves the weights by lr ({lr}) times its direction, however far that is.")
    fixes.append(f"Lower lr (now {lr}; LBFGS's default is 1"
                 + (", and with line_search_fn='strong_wolfe' it is the first step length the "
                    "search tries)." if line_search_fn else ")."))
    fixes.append(f"Take fewer iterations per step (max_iter, now {max_iter}): one "
                 "optimizer.step(closure) makes up to max_iter updates before your loop sees the "
                 "loss it returns; check that loss with torch.isfinite between steps.")
    if dtype in _LOW_PRECISION:
        fixes.append("Keep the weights in float32 for LBFGS (its curvature pairs s, y and "
                     "their products overflow float16 first).")
    return fixes


# A value inside each op's domain, away from its edge: what a guarded argument takes where the
# result is not used (torch.where(mask, x, safe)).
_SAFE_ARGUMENT = {"log1p": "0", "acos": "0", "asin": "0", "atanh": "0", "erfinv": "0",
                  "acosh": "2", "logit": "0.5"}


_FUSED_LOG_PROBABILITIES = (
    "Compute the log-probabilities from the logits{at}, not as a log of probabilities: a "
    "probability that rounds to 0 (or to 1 in log(1 - p)) gives log(0) = -inf. "
    "F.log_softmax(logits, dim) instead of torch.log(torch.softmax(logits, dim)); "
    "F.logsigmoid(x) and F.logsigmoid(-x) for log(p) and log(1 - p) of p = sigmoid(x); "
    "F.binary_cross_entropy_with_logits(logits, y) (nn.BCEWithLogitsLoss) instead of "
    "-(y * log(p) + (1 - y) * log(1 - p)), nn.CrossEntropyLoss on the logits instead of a "
    "sum of one-hot targets times log(p).")
_LOGIT_SQUEEZE = ("Squeeze the data away from 0 and 1 before the logit, as RealNVP and Glow "
                  "do: x = alpha + (1 - 2 * alpha) * x with alpha = 0.05 (or 1e-6 for a "
                  "guard alone), adding log(1 - 2 * alpha) per dimension to the log-det; and "
                  "dequantize images first, x = (x * 255 + torch.rand_like(x)) / 256.")
_SPLINE_FLOORS = ("A rational-quadratic spline's bin width, height or knot derivative reached "
                  "0 (a softmax or softplus that underflowed): floor them as nflows and zuko "
                  "do, widths = min_w + (1 - min_w * K) * F.softmax(w, -1) (the same for the "
                  "heights) and derivatives = min_d + F.softplus(d), with min_bin_width = "
                  "min_bin_height = min_derivative = 1e-3.")


def domain(op: str, at: str, backward: bool, empty: bool = False,
           unused_gradient: bool = False, negative_running_var: bool = False,
           hint: str = "", masked_on_line: bool = True) -> list[str]:
    """``hint`` (what the op's line reads like): "logit" (a logit transform of data in [0, 1]),
    "spline" (a spline flow's log-derivative or division by a bin's size) or "probabilities"
    (a log of probabilities made by hand: log(softmax(x)), a binary cross-entropy's
    log(1 - p)). ``masked_on_line``: the op's line selects with torch.where or a mask (an
    unused gradient's fix is then to guard the argument, else an eps inside the op)."""
    name = op.lstrip("_").rstrip("_")  # pow_ is pow
    if hint == "logit" and name in ("log", "log2", "log10", "log1p", "logit"):
        return [_LOGIT_SQUEEZE] + domain(op, at, backward, empty, unused_gradient)
    if hint == "spline":
        return [_SPLINE_FLOORS] + domain(op, at, backward, empty, unused_gradient)
    if hint == "probabilities" and name in ("log", "log2", "log10"):
        return [_FUSED_LOG_PROBABILITIES.format(at=at)] + [
            line for line in domain(op, at, backward, empty, unused_gradient)
            if not line.startswith("For probabilities use the fused forms")]
    if negative_running_var:
        return [f"Mend the running statistics{at}: a write or a load put a negative value in "
                "running_var (BatchNorm's updates never do). Reload them from a good "
                "checkpoint, or clamp them: module.running_var.clamp_(min=0).",
                "Or recompute them: model.train() and a few forwards without gradients (with "
                "momentum=None for an exact average), then model.eval()."]
    if unused_gradient and name not in ("var", "std", "var_mean", "std_mean", "ctc_loss"):
        # The where trap: the result is masked after the op, its gradient is not.
        if name in ("div", "true_divide"):
            unguarded, guarded = "torch.where(mask, x / d, 0)", "x / torch.where(mask, d, 1)"
        else:
            unguarded = f"torch.where(mask, torch.{name}(x), 0)"
            guarded = f"torch.{name}(torch.where(mask, x, {_SAFE_ARGUMENT.get(name, '1')}))"
        first = (f"Guard the argument of {name}{at}, not its result: {unguarded} still gives a "
                 f"NaN gradient where x is at the edge (where passes {name} a gradient of 0, "
                 f"and 0 x inf = NaN). Write {guarded} instead.")
        if not masked_on_line:  # no where there (a hinge cut it off): the op's own fixes first
            return domain(op, at, backward, empty) + [first.replace(
                "Guard the argument", "If a mask or torch.where drops the value later, guard "
                "the argument", 1)]
        return [first] + domain(op, at, backward, empty)
    if empty:
        return [f"Guard the reduction{at} against an empty selection: compute it only when "
                "x.numel() > 0, or divide a sum by the count clamped to at least 1 "
                "(x.sum() / mask.sum().clamp_min(1)).",
                "If every batch should select something, look at the mask or filter before it "
                "(a threshold no value passes, a class absent from the batch)."]
    if name in ("ctc_loss", "cudnn_ctc_loss", "use_cudnn_ctc_loss"):
        how = ("Pass zero_infinity=True to F.ctc_loss / nn.CTCLoss" if "/transformers/" not in
               at.replace("\\", "/") else "Set ctc_zero_infinity=True in the model's config "
               "(from_pretrained(..., ctc_zero_infinity=True), or model.config.ctc_zero_infinity "
               "= True)")
        return [f"{how}: a sample without an alignment then adds 0 to the loss and to the "
                "gradients.",
                "Or drop the samples whose input length (after the model's downsampling) is "
                "shorter than their target length plus one blank per repeated label."]
    if name in _NORMALISATIONS:
        return [f"Give the normalisation{at} an eps > 0, e.g. its default: nn.GroupNorm / "
                "nn.LayerNorm / nn.BatchNorm2d(..., eps=1e-5) (diffusers' norm_eps / "
                "resnet_eps, 1e-5 or 1e-6; transformers' layer_norm_eps): a group of equal "
                "values (a blank image, a constant channel, a padded row) then normalises to 0 "
                "instead of 0/0.",
                "If eps came from a config or a checkpoint's settings (norm_eps=0), set it there: "
                "every norm built from it divides by sqrt(var + eps)."]
    if name in ("weight_norm_interface", "weight_norm"):
        return ["A slice of the weight-normalised layer's v (weight_v, or "
                "parametrizations.weight.original1) is all zeros, so its norm is 0: "
                "re-initialise that slice (or the layer) from a good checkpoint.",
                "Find what zeroed it: a write or a load, or weight decay / pruning driving a "
                "whole row to 0; a parametrization of your own can divide by "
                "(norm + eps) instead."]
    if name in ("xlogy", "special_xlog1py"):
        return [f"Keep the second argument of {name}{at} above 0: a Poisson rate or a "
                "probability from softplus / exp / sigmoid can underflow to exactly 0, so "
                "floor it: F.softplus(x) + eps or rate.clamp_min(eps), eps = 1e-6.",
                "Or compute the log-likelihood from the logits: PoissonNLLLoss(log_input=True), "
                "Binomial/Categorical(logits=...) instead of probs."]
    if name == "log1p":  # its argument's edge is -1, not 0: log1p(-p) is log(1 - p)
        return [f"Keep the argument of log1p{at} above -1: torch.log1p(x.clamp_min(-1 + eps)), "
                "eps = 1e-6 (1e-3 in float16); for log(1 - p) of a probability, "
                "torch.log1p(-p.clamp_max(1 - eps)).",
                "For probabilities use the fused forms: log(1 - sigmoid(x)) is "
                "F.logsigmoid(-x); nn.BCEWithLogitsLoss on the logits instead of BCELoss."]
    if name == "logit":
        return [f"Clamp the argument of logit{at} into (0, 1): torch.logit(x, eps=1e-6) does "
                "it (x.clamp(eps, 1 - eps)); a probability from a sigmoid can be passed as "
                "its logits instead."]
    if name in ("log", "log2", "log10"):
        return [f"Keep the argument of {name}{at} positive: torch.{name}(x.clamp_min(eps)) or "
                f"torch.{name}(x + eps), eps = 1e-6 (1e-4 in float16).",
                "For probabilities use the fused forms: F.log_softmax instead of log(softmax(x)), "
                "F.logsigmoid instead of log(sigmoid(x)), nn.BCEWithLogitsLoss / "
                "nn.CrossEntropyLoss on the logits."]
    if name in ("lgamma", "digamma", "polygamma"):
        return [f"Keep the argument of {name}{at} positive: a count/concentration parameter "
                "(a negative binomial's total_count, a Gamma/Beta/Dirichlet concentration) from "
                "softplus or squareplus can reach exactly 0, so add a floor: "
                "F.softplus(x) + eps or .clamp_min(eps), eps = 1e-6.",
                "Check the data too: a negative count target gives lgamma of a negative value."]
    if name in ("sqrt", "rsqrt"):
        if backward:
            return [f"The gradient of {name} is infinite at 0: add an eps inside, "
                    f"torch.{name}(x + eps) at {at.strip()[3:] or 'that line'}, or use "
                    "torch.linalg.vector_norm (its gradient at 0 is defined) for a norm.",
                    "Or keep x away from 0 where the gradient flows: torch.where(x > eps, x, eps)."]
        return [f"Clamp the argument of {name}{at}: torch.{name}(x.clamp_min(eps)) (a negative "
                "value gives NaN, rsqrt(0) gives inf).",
                "If x is a variance or a squared distance, it is negative only by rounding: "
                "clamp_min(0) before the root."]
    if name in ("acos", "asin", "atanh", "acosh", "erfinv"):
        return [f"Clamp the argument of {name}{at} into its open domain: "
                f"torch.{name}(x.clamp(-1 + eps, 1 - eps)) (its gradient is infinite at the edge).",
                "Normalised vectors can leave [-1, 1] by rounding: clamp the dot product before "
                f"{name}."]
    if name in ("div", "true_divide", "reciprocal", "remainder", "fmod", "floor_divide"):
        guard = [f"Guard the denominator{at}: x / (d + eps) or x / d.clamp_min(eps) (for a "
                 "denominator that can be negative: d + eps * torch.sign(d)).",
                 "torch.where(d == 0, 0, x / d) still gives a NaN gradient: divide by "
                 "torch.where(d == 0, 1, d) instead."]
        if backward:  # a gradient divided by 0: sqrt, a norm or a division at 0 in the forward
            return [f"A gradient divided by zero: the op{at} has an infinite slope there "
                    "(sqrt or a norm of 0, a division by 0). Add an eps inside "
                    "(torch.sqrt(x + eps)) or use torch.linalg.vector_norm for a norm."] + guard
        return guard
    if name in ("nll_loss_forward", "nll_loss2d_forward"):
        return ["The batch has no target to learn from (every label ignored: a prompt "
                "truncated before its answer, rows that are all padding): drop such examples "
                "from the data, or skip the step when (labels != ignore_index).sum() == 0.",
                "Or average over the counted targets with a floor: F.cross_entropy(logits, "
                "labels, reduction='sum') / (labels != ignore_index).sum().clamp_min(1)."]
    if name == "pow" and backward:  # the forward was finite: its slope at 0 is the cause
        return [f"The gradient of pow{at} is infinite at a base of 0 for exponents below 1 "
                "(x.pow(0.5) is sqrt): add an eps to the base, (x + eps).pow(p), or for a norm "
                "use torch.linalg.vector_norm (its gradient at 0 is defined)."] + [
            line for line in domain(op, at, False, empty) if not line.startswith("Its gradient")]
    if name == "pow":
        return [f"pow{at} of a negative base with a fractional exponent is NaN, and of 0 with a "
                "negative exponent inf: clamp the base (x.clamp_min(eps)) or use "
                "x.abs().pow(p) * x.sign().",
                "A count or a degree raised to a negative power (a graph's D^-1/2 normalisation, "
                "an inverse frequency) is inf where the count is 0: clamp the count "
                "(deg.clamp(min=1)) or zero those entries after the power, as GCN's "
                "normalisation does: d = deg.pow(-0.5); d.masked_fill_(d == float('inf'), 0).",
                "Its gradient at 0 is infinite for exponents below 1: add an eps to the base."]
    if name in ("var", "std", "var_mean", "std_mean"):
        return [f"{name}{at} over a single element divides by n - 1 = 0: pass correction=0 "
                "(unbiased=False), or make sure the reduced dimension has at least 2 elements "
                "(batch size 1, a sequence of length 1).",
                "Over the batch's dimension, a DataLoader's last batch holds one sample when the "
                "dataset's size is one more than a multiple of the batch size: "
                "DataLoader(..., drop_last=True) drops it.",
                "Add an eps where it is divided by: x / (std + eps)."]
    if name in ("sub", "add", "rsub", "mul"):
        return [f"{name}{at} met an Inf (inf - inf or 0 x inf make NaN): find where the Inf was "
                "made (the report's earlier op) and keep that value finite (clamp, or mask with "
                "torch.finfo(dtype).min instead of -inf).",
                "Replace a by-hand formula with its stable library form (F.softmax, "
                "torch.logsumexp, F.log_softmax)."]
    if name in ("linalg_eigh", "linalg_eig", "linalg_svd", "svd"):
        values = "singular values" if "svd" in name else "eigenvalues"
        only = "torch.linalg.svdvals" if "svd" in name else "torch.linalg.eigvalsh"
        return [f"Separate the repeated {values} before the decomposition{at}: add a small "
                "perturbation that differs per entry, e.g. A + 1e-6 * torch.diag(torch.arange("
                "1, n + 1)) or a tiny random symmetric matrix. The same eps on the whole "
                "diagonal (A + eps * I) shifts them all and leaves them equal.",
                f"If only the {values} are used, take them with {only}: its gradient is defined "
                "at repeated values. The vectors' gradient is not: at a repeated value any "
                "vector of its subspace is a solution."]
    if name in ("logdet", "linalg_slogdet", "_linalg_slogdet", "det", "linalg_det"):
        return [f"The matrix{at} is singular (or, for logdet, its determinant is negative): add "
                "jitter to its diagonal, A + eps * torch.eye(n) (eps = 1e-6 x its scale), or "
                "build it positive definite (L @ L.T + eps * I) and take "
                "2 * torch.log(torch.linalg.cholesky(A).diagonal(dim1=-2, dim2=-1)).sum(-1).",
                "torch.linalg.slogdet returns the sign and log|det| separately: a negative "
                "determinant then gives no NaN (log|det| is still -inf at det = 0)."]
    return [f"Keep the input of {name}{at} inside its domain (clamp it, or add an eps)."]


def no_counted_label() -> list[str]:
    """A batch whose every label is the ignore_index, whose loss transformers divides by the
    ``num_items_in_batch`` the Trainer counted (0): the data's fixes, not its loss code's."""
    return ["The batch has no label to learn from (every label ignored: a prompt truncated "
            "before its answer, a completion-only collator that masked everything): drop such "
            "examples from the dataset before training, e.g. dataset.filter(lambda ex: "
            "any(label != -100 for label in ex['labels'][1:])) (a causal LM's loss never counts "
            "the first label).",
            "Or keep the answer in: a larger max_length, or cut the prompt rather than the "
            "completion when an example is too long."]


def distribution_parameter(at: str) -> list[str]:
    return [f"The op ran inside a torch.distributions method called{at}: a parameter of the "
            "distribution left its domain (a scale, rate or concentration at or below 0, a "
            "probability at 0 or 1). Keep it inside where it is made: scale = "
            "F.softplus(raw) + 1e-4 (or a clamped log-scale's exp()); Categorical / Bernoulli("
            "logits=...) instead of probs=...; validate_args=True raises at the bad value."]


def masked_row() -> list[str]:
    return ["Fill masks with torch.finfo(scores.dtype).min instead of -inf: a fully masked row "
            "then gives a finite (uniform) softmax instead of NaN.",
            "Guard fully masked rows: drop sequences that are all padding, or unmask one position "
            "for them (e.g. the first token) and zero their output afterwards.",
            "nn.MultiheadAttention / nn.TransformerEncoder: a key_padding_mask row that is all "
            "True masks every key of that sequence; check the rows named here."]


def masked_left_padding(at: str) -> list[str]:
    """A causal softmax masked with -inf over a left-padded batch: the padding positions'
    queries see no key. Their outputs are never used, so any finite value will do."""
    return [f"Fill the mask of the softmax{at} with torch.finfo(scores.dtype).min instead of "
            "-inf: the padding positions then get a finite (uniform) softmax, which nothing "
            "reads (as transformers' eager attention does).",
            f"Or zero the rows that see no key after the softmax{at}: "
            "probs.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0), or use "
            "F.scaled_dot_product_attention, which gives 0 there."]


def summed_masks(at: str, both: bool) -> list[str]:
    """Masks filled with ``torch.finfo(dtype).min`` added together (``both``), or one added to
    scores below 0, that passed the dtype's lowest value."""
    if not both:  # one mask and the scores: the scores' size is half the cause
        return [f"Apply the mask without adding it{at}: scores.masked_fill(~keep, "
                "torch.finfo(scores.dtype).min) instead of scores + mask.",
                f"Or clamp the sum back to the lowest value{at}: (scores + mask).clamp_min("
                "torch.finfo(scores.dtype).min).",
                "Or keep the scores in range: compute them in float32 (upcast q and k, or "
                "torch.autocast) or smaller (scaled by 1/sqrt(head_dim), normalised inputs); "
                "scores this large overflow float16 elsewhere too."] + masked_row()[1:2]
    fixes = [f"Combine the masks without adding them{at}: torch.minimum(mask_a, mask_b), or "
             "combine the boolean masks (keep_a & keep_b) and fill once: "
             "scores.masked_fill(~keep, torch.finfo(scores.dtype).min).",
             f"Or clamp the sum back to the lowest value{at}: (scores + mask).clamp_min("
             "torch.finfo(scores.dtype).min).",
             "Running it in bfloat16 or float32 does not help: the masks follow the dtype, and "
             "torch.finfo(dtype).min + torch.finfo(dtype).min is -inf in every dtype."]
    return fixes + masked_row()[1:2]  # a fully masked row still needs its guard


def written_inf(modules: list[str], op: str, at: str) -> list[str]:
    names = ", ".join(f"'{m}'" for m in modules)
    return [f"If the Inf is meant (the code after it reads it safely: a sigmoid, a min, a topk), "
            f"let those outputs hold ±inf: nw.watch(model, allow_inf=[{names}]) (NaN still "
            "counts; name globs work too).",
            f"If not, write a finite value{at}: torch.finfo(x.dtype).max (or .min) instead of "
            f"inf in {op}, so that no later op makes inf - inf or 0 x inf = NaN."]


def written_inf_made_nan(module: str, op: str, at: str) -> list[str]:
    return [f"Write a finite value{at}: torch.finfo(x.dtype).min (or .max) instead of inf in "
            f"{op} (a padding value: pad_sequence / pad_packed_sequence(..., padding_value=0.0)), "
            "so that no later op makes inf - inf or 0 x inf = NaN.",
            f"Or keep those positions out of the arithmetic: mask them before module '{module}' "
            "(torch.where(mask, x, 0) on its input), not only after it.",
            "allow_inf does not help here: NaN always counts."]


def cast_to_float16(names: list[str]) -> list[str]:
    name = names[0]
    return ["Keep the weights in float32 and compute in float16 under torch.autocast(device_type, "
            "dtype=torch.float16): it casts per op and keeps normalisation layers in float32.",
            "Or cast to bfloat16 instead (the range of float32): model.to(torch.bfloat16), or "
            "torch_dtype=torch.bfloat16 in from_pretrained.",
            f"Or find the values in the float32 weights: (w.abs() > 65504).sum() for '{name}'; "
            "keep the module that holds them in float32 (and hand it x.float()), or rescale them."]


def cast_to_float8(names: list[str], dtype: str, largest: str) -> list[str]:
    name = names[0]
    return [f"Scale the values into {dtype}'s range before the cast: scale = "
            f"w.abs().amax() / {largest}, store (w / scale).to(torch.{dtype}) and multiply by "
            "scale after casting back (a per-tensor or per-channel scale, as float8 recipes do).",
            f"Or find the values in the float32 weights: (w.abs() > {largest}).sum() for "
            f"'{name}', and keep that tensor in a wider dtype."]


def _float16_step(optimizers: dict[str, bool], gradients_checked: bool) -> list[str]:
    """What can make a float16 weight Inf in an optimizer step, for the optimizers that stepped
    (class name -> whether it divides by an eps; empty: none seen, so any may have)."""
    fixes = []
    with_eps = [name for name, eps in optimizers.items() if eps]
    without_eps = [name for name, eps in optimizers.items() if not eps]
    if with_eps or not optimizers:
        who = "/".join(with_eps) or "Adam/AdamW"
        fixes.append(f"{who} on float16 weights: an eps of 1e-8 (the default of Adam, AdamW and "
                     "RMSprop) is 0 in float16, so a step divides by ~0. Use eps=1e-4 or larger, "
                     "or keep the weights in float32 (torch.autocast for float16 compute, with "
                     "torch.amp.GradScaler).")
    if without_eps:
        see = "" if gradients_checked else (" (watch with backward=True to see which gradient "
                                            "overflowed)")
        fixes.append(f"{'/'.join(without_eps)} on float16 weights: a gradient that overflowed "
                     "float16 (a weight's gradient sums over the batch), or an update past "
                     "65504, writes Inf in the step" + see + ". Keep the weights in float32 and "
                     "compute in float16 under torch.autocast with torch.amp.GradScaler (it skips "
                     "the steps whose gradients overflowed), lower the learning rate, or clip the "
                     "gradients before the step.")
    return fixes


def added_module(module: str, bad: str) -> list[str]:
    """Weights of a module added or replaced after watch() (a fused conv, a swapped layer);
    ``bad``: what they hold ("NaN", "Inf" ...)."""
    return [f"Check '{module}' before putting it in the model: all(t.isfinite().all() for t in "
            f"model.get_submodule('{module}').state_dict().values()). What made it made the "
            f"{bad}: a fusion folds a BatchNorm into the layer before it "
            "(torch.nn.utils.fusion.fuse_conv_bn_eval or fuse_linear_bn_eval, "
            "torch.ao.quantization.fuse_modules): check that the BatchNorm's running_mean, "
            "weight and bias are finite and its running_var finite and not negative "
            "(bn.running_var.min() >= 0); a module loaded from a checkpoint: check the "
            "checkpoint; one copied from another model: check that model.",
            "Watch the model again after changing its modules (w.close(); w = nw.watch(model)): "
            "the new module is then hooked and its own weights measured, so an event names the "
            "batch after which they turned."]


def corrupted_weight(names: list[str], dtype: str, batch: int | None, inf_only: bool,
                     before_watch: bool = False, *, stepped: bool = True, no_step: bool = False,
                     replaced: bool = False, gradients_checked: bool = False,
                     gradients_finite: bool = False,
                     optimizers: dict[str, bool] | None = None,
                     sharded_unchecked: bool = False) -> list[str]:
    """``stepped``: an optimizer step may have written the weights (False: buffers, or
    parameters no step updated: the step's fixes cannot help); ``no_step``: no optimizer step
    ran under the watch at all (inference). ``replaced``: their slots hold other tensors than
    when last finite (a load with assign=True). ``gradients_checked``: the watch checks the
    gradients (backward=True); ``gradients_finite``: and none was non-finite before the event.
    ``optimizers``: those that stepped (class name -> whether it divides by an eps).
    ``sharded_unchecked``: full mode, and the weights are parameters FSDP2 shards, whose
    gradients it does not measure (backward=True or not)."""
    after = f"after batch {batch}" if batch is not None else "before this batch"
    name = names[0] if names else "the weight"
    fixes = []
    if replaced and not before_watch:
        bad = "Inf" if inf_only else "NaN/Inf"
        fixes.append(f"{name} was replaced {after} by another tensor that held {bad} (a "
                     "load_state_dict(..., assign=True), module.weight = nn.Parameter(...)): "
                     "check what it came from before putting it in: all(v.isfinite().all() for "
                     "v in state_dict.values()) for a checkpoint, torch.isfinite(t).all() for a "
                     "tensor; then reload from finite weights.")
        if not stepped:
            return fixes
    if no_step and not stepped and not before_watch:
        return [f"No optimizer step ran while the watch was live: look for what wrote {name} "
                f"{after}: a load_state_dict of a bad checkpoint (check all(v.isfinite().all() "
                "for v in state_dict.values()) before loading), a copy_ or p.data = ... from "
                "another tensor, or an indexed write under torch.no_grad(); check the source "
                "with torch.isfinite(t).all() before the write, and skip it when it is not.",
                "Reload the weights from a finite checkpoint (or from the model's state before "
                "the write)."]
    if not stepped and not before_watch:
        return [f"No optimizer step wrote {name}: look for what else wrote it {after}: an EMA "
                "or AveragedModel update (update_parameters, torch._foreach_lerp_ from the "
                "source model), a copy_ or p.data = ... from another model, or a "
                "load_state_dict of a bad checkpoint. Check the source with "
                "torch.isfinite(t).all() before the write, and skip the update when it is not.",
                "If it averages or copies another model (an EMA of the model being trained), "
                "that model went non-finite first: watch it too (nw.watch(model)) to find where; "
                "then reload the copy from a checkpoint, or copy it again from finite weights."]
    if before_watch:
        fixes.append(f"It was non-finite before the first batch watched: check what it came "
                     f"from (a checkpoint: all(v.isfinite().all() for v in "
                     f"state_dict.values()), or a write to {name} before nw.watch()), and "
                     "reload or recompute it.")
    elif gradients_checked and gradients_finite:
        # No step ran on a non-finite gradient: the usual advice (catch that step) cannot help.
        fixes.append(f"The watch checked every gradient (backward=True) and none was "
                     "non-finite, so no step read a NaN/Inf gradient from backward: look for what "
                     f"else wrote {name} {after}: a load_state_dict of a bad checkpoint, or an "
                     "in-place write (a target-network, EMA or Polyak update, p.data = ..., a "
                     "copy_ or an indexed write under torch.no_grad()); check its source with "
                     "torch.isfinite(source).all() before writing.")
        fixes.append("Or the optimizer step made it from finite gradients: a learning rate too "
                     "large (or a schedule gone wrong), optimizer state gone non-finite "
                     "(optimizer.state), or a float16 overflow in the update.")
    if dtype == "float16":  # an eps of 0 in float16 makes 0/0 = NaN as well as x/0 = Inf
        fixes.extend(_float16_step(optimizers or {}, gradients_checked and not before_watch))
    # Before the watch, no step of this run wrote it: the steps' advice is for the run that
    # saved the checkpoint, if one did.
    within = "In the run that saved it: c" if before_watch else "C"
    if sharded_unchecked and not before_watch:
        fixes.append("Catch the bad step before it writes the weights: full mode does not "
                     "measure the gradients of parameters FSDP2 shards, so watch with "
                     "mode='sentinel', backward=True (it checks each rank's gradient shards and "
                     "stops every rank before the step), or call w.check_grad_norms() on every "
                     "rank before optimizer.step() and skip the step when it returns True.")
    elif before_watch or not gradients_checked:
        fixes.append(f"{within}atch the bad step before it writes the weights: watch with "
                     "backward=True (a non-finite gradient stops there), or call "
                     "w.check_grad_norms() before optimizer.step() and skip the step when it "
                     "returns True.")
    elif not gradients_finite:
        fixes.append("Catch the bad step before it writes the weights: backward=True saw a "
                     "non-finite gradient before this (on_nan='raise' stops there), or call "
                     "w.check_grad_norms() before optimizer.step() and skip the step when it "
                     "returns True.")
    fixes.append(f"{within}lip the gradients before the step: "
                 "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0); with float16, "
                 "torch.amp.GradScaler skips steps whose gradients hold Inf/NaN.")
    if not before_watch and not (gradients_checked and gradients_finite):
        fixes.append(f"If no optimizer step ran {after}: look for a load_state_dict of a bad "
                     f"checkpoint or an in-place write to {name}.")
    return fixes


def loaded_nonfinite(names: list[str], what: str, *, dcp: bool) -> list[str]:
    """Fixes for weights a load of the model's state made non-finite (``what``: "NaN",
    "Inf" ...); ``dcp``: torch.distributed.checkpoint loaded them."""
    name = names[0] if names else "the weight"
    check = ("[k for k, v in state_dict.items() if torch.is_tensor(v) and v.is_floating_point() "
             "and not torch.isfinite(v).all()]")
    if dcp:
        first = (f"Check the state dict that dcp.load filled before handing it to the model "
                 f"(set_model_state_dict(model, state_dict) or model.load_state_dict): {check} "
                 f"names {name}; under FSDP each rank holds its own shards (v.to_local() of a "
                 "DTensor), so check on every rank, and do not load a checkpoint any rank "
                 "finds non-finite.")
    else:
        first = (f"Check the state dict before loading it: {check} names {name}; do not load "
                 "a checkpoint that holds non-finite values.")
    return [first,
            f"Load an earlier checkpoint: this one was saved with {what} in {name}, so the run "
            "that saved it had gone non-finite by then. Watch that run (nw.watch(model), or "
            "mode='sentinel' for a long one) to find the step that made it, and save "
            "checkpoints only while the weights are finite."]


def rows_named(rows: list[int], limit: int) -> str:
    """"row 3" / "rows 2, 4 ..." (at most ``limit`` numbers)."""
    more = " ..." if len(rows) > limit else ""
    return f"row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:limit]))}{more}"


def in_rows(rows: list[int], limit: int) -> str:
    """" in row 3" / " in rows 2, 4 ..."; "" without rows."""
    return f" in {rows_named(rows, limit)}" if rows else ""


def bad_data(roles: list[str], rows: list[int], samples: list[str] | None = None,
             log_of_zero: bool = False) -> list[str]:
    """Fixes for inputs that came with NaN/Inf: a mask's (named like one: how it was built;
    a finiteness check or nan_to_num would break any valid -inf mask), then the data's.
    ``samples``: the bad inputs as samples of list inputs ("input[1][0].boxes (box 1 of
    sample 0)"), when every one is: named instead of rows of their own tensors.
    ``log_of_zero``: the data holds -inf only (no NaN, no +inf), as a log of 0 gives: the
    floor before the log comes first."""
    masks = [role for role in roles if "mask" in role.lower()]
    data = [role for role in roles if role not in masks]
    fixes = mask_built_with_nan(masks) if masks else []
    if not data and masks:
        return fixes
    which = ", ".join(data) or "the input"
    if samples:
        shown = f"{', '.join(samples)} {'was' if len(samples) == 1 else 'were'}"
    elif rows:
        shown = f"{rows_named(rows, 8)} of {which} {'was' if len(rows) == 1 else 'were'}"
    else:
        shown = f"the rows of {which} that hold NaN/Inf were"
    if log_of_zero:
        fixes = fixes + [
            f"Only -Inf, no NaN and no +Inf: the mark of a log of 0 where {which} was made (a "
            "log-mel or log spectrogram of a silent frame or a zero-padded tail, a log of a "
            "probability of 0). Put a floor under the log: torch.log10(torch.clamp(mel, "
            "min=1e-10)), as transformers' WhisperFeatureExtractor does, or torch.log(x + 1e-6)."]
    return fixes + [
        f"Look at how {shown} made: missing values, a division by zero or "
        "log(0) in preprocessing, a corrupt file.",
        "Guard the data: assert torch.isfinite(x).all() in the Dataset or collate_fn, or "
        f"clean it (torch.nan_to_num, or drop those {'samples' if samples else 'rows'}) "
        "before the forward.",
        "Normalise features with an epsilon: (x - mean) / (std + 1e-6)."]


def sampling_step(roles: str, before: int) -> list[str]:
    """A sampling loop's input made non-finite by the step between two calls of the model
    (a diffusers scheduler's step(...), an ODE solver's update), not by a dataset."""
    return [f"If the model runs in a sampling loop, {roles} is the previous step's result: look "
            f"at the step after batch {before} (scheduler.step(...) or the solver's update), "
            "and check the latents after each step: assert torch.isfinite(latents).all().",
            "diffusers: a zero terminal SNR schedule (rescale_betas_zero_snr=True) has "
            "alphas_cumprod = 0 at the last timestep, so step() divides by sqrt(alpha_prod_t) = 0 "
            "there unless prediction_type='v_prediction' (what such a schedule needs; train the "
            "model with it); with timestep_spacing='trailing' the first step of sampling is that "
            "timestep. A clip_sample=False scheduler lets such values through unclipped."]


def mask_built_with_nan(roles: list[str]) -> list[str]:
    """A mask passed in holding NaN: made by arithmetic on -inf (0 x -inf, inf - inf)."""
    return [f"Build {', '.join(roles)} without arithmetic on -inf: (1 - keep) * -inf is NaN "
            "where keep is 1 (0 x -inf = NaN). Write it with masked_fill or torch.where: "
            "torch.zeros(shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min), or "
            "torch.where(keep, 0.0, torch.finfo(dtype).min) (finfo.min rather than -inf also "
            "keeps a fully masked row finite).",
            "Or pass the model the 0/1 (or boolean) mask it takes and let it build the "
            "additive one."]


def loss(batch: int, op: str, traced: bool, at: str = "", has_loss_fn: bool = False,
         zero_over_zero: bool = False, snr: bool = False, from_targets: bool = False,
         boxes: bool = False, given_finite: bool = False, function: str = "",
         family: str = "", targets_held: str | None = None, target_rows: list[int] | None = None,
         made: str = "") -> list[str]:
    """``op``: the loss's op that made the value (its forward op's name for a gradient), ``at``
    its line; ``has_loss_fn``: the watch was given loss_fn (never advise passing it);
    ``zero_over_zero``: that op is a division of 0 by 0; ``snr``: its line divides by an SNR
    (a diffusion loss's min-SNR weighting); ``from_targets``: the op read none of the model's
    output, only the targets (or other tensors loss_fn holds); ``boxes``: those are box
    regression targets (a log of box widths or heights); ``given_finite``: the loss is a module
    whose inputs were seen finite (the caller says how to name its op). Untraced, what the
    loss told of itself (``NanWatch.explain_loss``): ``function`` and ``family``, torch's loss
    function that made it and what it compares (facts.LOSS_FUNCTIONS), ``targets_held`` what
    its targets held (None: not given; "": all finite; "an Inf" ...) in ``target_rows``;
    ``made``: the loss's kind ("nan", "inf")."""
    fixes = []
    untraced = not traced and not given_finite  # nothing named the op, nor could be seen
    if untraced and has_loss_fn:
        fixes.append(f"See every op of the loss and its backward: w.replay({batch}, "
                     "loss_fn=your_loss_fn).report() (run it within the failing step, while "
                     "the loss's targets and weights are those of that batch).")
    elif untraced:
        fixes.append(f"{NAME_THE_LOSS_OP}criterion(out, targets) (automatic replays then run "
                     f"the loss), or now w.replay({batch}, loss_fn=...).")
    if untraced and (function or targets_held is not None):
        # The loss said what it is, or its targets were read: the likeliest cause first, the
        # way to name the op after it.
        return _told_loss(function, family, targets_held, target_rows or [], made) + fixes \
            + ([] if function or targets_held else [_OTHER_TENSORS])
    name = op.lstrip("_").rstrip("_")  # pow_ is pow
    if traced and name in ("div", "true_divide", "reciprocal"):
        # A denominator that reached 0 (a weighting such as min-SNR's min(snr, 5) / snr).
        guard = domain(op, at, backward=False)
        if zero_over_zero:
            guard[0] = (f"Guard the denominator{at}: numerator and denominator are both 0 for "
                        "some samples (an empty mask in a Dice or IoU loss, a weight of 0), so "
                        "add a smoothing term to both, (x + eps) / (d + eps) (MONAI's Dice "
                        "losses: smooth_nr and smooth_dr above 0), or divide by "
                        "d.clamp_min(eps).")
        if not snr:
            return fixes + guard
        return fixes + guard + [
            "Or special-case the samples whose denominator is 0: after a min-SNR weighting "
            "min(snr, gamma) / snr, set weights[snr == 0] = 1.0 (diffusers' training scripts "
            "do, for a zero terminal SNR)."]
    if traced and from_targets:
        return fixes + targets(op, at, boxes)
    if not traced or name in ("log", "log2", "log10", "log1p", "sigmoid", "softmax",
                              "binary_cross_entropy", "nll_loss"):
        fixes.extend(_LOGITS_FIXES)
    else:
        fixes.extend(domain(op, "", backward=False))
    if untraced:
        fixes.append(_OTHER_TENSORS)
    return fixes


# How the first fix of an untraced loss begins (the wrappers word it whole).
NAME_THE_LOSS_OP = "Name the loss's op and line: watch with loss_fn=lambda out: "
# Untraced, the NaN may as well have come in with a tensor the loss reads: another model's
# output (TRL's DPO and KL terms read a frozen reference model's log-probs).
_OTHER_TENSORS = ("Or the loss read a NaN/Inf made before it ran, in a tensor besides the "
                  "model's output: another model's output (a frozen reference or teacher "
                  "model, whose log-probs DPO losses and KL penalties read; a target "
                  "network), targets, rewards or advantages. Watch that model too "
                  "(nw.watch(ref_model)), or assert torch.isfinite(t).all() where such a "
                  "tensor is made.")
_LOGITS_FIXES = ["Use the fused, stable losses on the logits: nn.BCEWithLogitsLoss instead "
                 "of log(sigmoid(x)) by hand, nn.CrossEntropyLoss or F.log_softmax instead "
                 "of log(softmax(x)).",
                 "Clamp probabilities before a log: p.clamp(eps, 1 - eps); compute the loss "
                 "in float32 (output.float()) under autocast."]


def _told_loss(function: str, family: str, targets_held: str | None, rows: list[int],
               made: str) -> list[str]:
    """The fixes of a loss of finite outputs that no trace named, from what it told: its
    function (torch's fused losses are finite on finite inputs in their domain, so the
    targets, or the function's own limit, made it) and its targets' values."""
    fixes = []
    named = f"{function} " if function else "the loss "
    if targets_held:
        fixes.append(f"Fix the targets: they held {targets_held}{in_rows(rows, 8)}, and "
                     f"{named}of finite outputs against a non-finite target is NaN/Inf. "
                     "Assert torch.isfinite(y).all() where they are made (the Dataset or its "
                     "transform: a missing value, a division by 0 or log(0) in "
                     "preprocessing), and drop or fix those samples.")
    weighted = " (or a loss weight: weight=, pos_weight=)" if family in (
        "probability", "logits") else ""
    check = ("Check the targets: " + named + "of the model's finite outputs is NaN/Inf when a "
             f"target is{weighted}. Assert torch.isfinite(y).all() where the targets are made "
             "(the Dataset or its transform), and drop or fix the samples that fail.")
    if family == "squared":
        if targets_held is None:
            fixes.append(check)
        if not targets_held:
            fixes.append("Or a squared difference passed the dtype's largest value: an output "
                         "or target past 1.8e19 in float32 (256 in float16) squares past it. "
                         "Scale the targets down (standardise them: (y - mean) / std), or use "
                         "nn.HuberLoss / nn.SmoothL1Loss, which grow linearly past delta.")
    elif family == "log-prob":
        if made != "inf":
            fixes.append("A mean over no target is 0/0: when every target of the batch is "
                         "ignore_index (-100), or the class weights of its targets sum to 0, "
                         "nll_loss and cross_entropy with reduction='mean' give NaN. Drop such "
                         "batches, or sum the loss and divide by max(count, 1).")
        if made != "nan":
            fixes.append("nll_loss takes log-probabilities: a log of a probability of 0 is "
                         "-inf. Pass F.log_softmax(logits, dim) (or use F.cross_entropy on the "
                         "logits) instead of log(softmax(x)) by hand.")
        # Its targets are class indices (integers: never NaN/Inf), so no check of their values.
    elif family in ("regression", "probability", "logits"):
        if targets_held is None:
            fixes.append(check)
        if family == "probability":
            fixes.append("Take the logits and use nn.BCEWithLogitsLoss instead of a sigmoid "
                         "then nn.BCELoss: stable, and allowed under autocast "
                         "(binary_cross_entropy clamps its log at -100, so probabilities in "
                         "[0, 1] alone give a finite loss).")
    elif not targets_held:  # the function not told, the targets finite: as without them
        fixes.extend(_LOGITS_FIXES)
    return fixes


def loss_module(module: str, module_type: str, batch: int, *, tiny_role: str,
                tiny: float | None, distribution: bool) -> list[str]:
    """A loss the model holds as a submodule made the gradient non-finite; ``tiny``: the
    smallest abs value of its input ``tiny_role``, when near 0; ``distribution``: the loss
    scores a distribution (its class says so)."""
    fixes = []
    given = f" ({tiny_role} reached {tiny:.3g})" if tiny is not None else ""
    if distribution:
        fixes.append(f"A parameter of the distribution that '{module}' ({module_type}) scores "
                     f"left its domain: a scale, rate or variance collapsed towards 0{given}. "
                     "Keep it away from 0 where the model makes it: scale = F.softplus(raw) + "
                     "1e-4 (or a clamped log-scale's exp()); lower the learning rate if the "
                     "scale shrank over the steps before.")
    elif tiny is not None:
        fixes.append(f"Keep {tiny_role} of '{module}' away from 0 where the loss divides by it or "
                     "takes its log: x.clamp_min(eps), or x + eps.")
    fixes.append(f"Name the loss's op and line: w.replay({batch}, loss_fn=lambda out: "
                 f"model.{module}(out, targets)).report(), within the failing step; or watch with "
                 "that loss_fn, so automatic replays run it.")
    return fixes


def targets(op: str, at: str, boxes: bool) -> list[str]:
    """The loss's op read only the targets (what loss_fn got besides the model's output)."""
    found = []
    if boxes:
        found.append("A degenerate target box (zero width or height: x2 <= x1 or y2 <= y1) "
                     "makes log(0) when boxes are encoded against anchors: drop such boxes in "
                     "the Dataset or transform (keep = (b[:, 2] > b[:, 0]) & (b[:, 3] > "
                     "b[:, 1]); b = b[keep], with its labels), or widen them to at least one "
                     "pixel.")
    found.append(f"Check the targets where the data loader makes them: {op}{at} read only "
                 "what loss_fn got besides the model's output (targets, anchors, weights): the "
                 "model did not make it. Assert "
                 "torch.isfinite(t).all() and the op's domain there (log: t > 0), and drop or "
                 "fix the samples that break it.")
    return found


def loss_input(op: str, at: str, held: str = "NaN/Inf") -> list[str]:
    """The NaN/Inf entered loss_fn through a tensor it reads besides the model's output;
    ``held``: what that tensor held ("a NaN", "an Inf", "NaN/Inf": not told)."""
    fixes = [f"Check the tensors {op}{at} reads besides the model's output (loss weights, "
             "targets, a mask; in reinforcement learning the rewards, and the returns and "
             f"advantages made from them): one held {held} before loss_fn ran. Check how it was "
             "made, and assert torch.isfinite(t).all() where it is made."]
    if "NaN" in held:
        fixes.append("A per-sample weighting that divides can make 0/0: min-SNR weights "
                     "min(snr, gamma) / snr are NaN at snr = 0 (a zero terminal SNR); set "
                     "weights[snr == 0] = 1.0 (diffusers' training scripts do) or divide by "
                     "snr.clamp_min(eps).")
    if "Inf" in held:
        fixes.append("Keep what it is made from finite (clip the rewards or targets, or drop the "
                     "sample whose value is inf): one Inf that a mean or a normalisation "
                     "((x - x.mean()) / x.std()) spreads makes every row NaN.")
    return fixes


def unseen_weights(module: str) -> list[str]:
    return [f"Check the tensors module '{module}' reads besides its inputs (a sampled weight, a "
            "tensor attribute) with torch.isfinite(t).all() where its forward gets them; with "
            "Pyro, check the guide's parameters (pyro.get_param_store()). A tensor registered "
            "with register_buffer() or as an nn.Parameter is measured by the watch."]


def unchecked_quantized_weights(module: str) -> list[str]:
    return [f"Check the weights of module '{module}' where they are still readable: the float "
            "model's, before quantizing it (all(p.isfinite().all() for p in "
            "model.parameters())), and the quantized ones (a torch.ao module's weight() and "
            "bias(), dequantized; a torchao weight's dequantize()). A NaN/Inf there, or in a "
            "quantization scale, gives this: quantize again from finite weights."]


def quantized_weight(module: str, role: str) -> list[str]:
    return [f"It is a quantized weight: check the float model's {module}.{role} before "
            "quantizing it (torch.isfinite(t).all()), and the quantization's scales (a scale of "
            "0 or NaN from a weight row that is all zero or non-finite, or one written since); "
            "quantize again from finite weights."]


def unknown(batch: int, replayable: bool, backward: bool = False,
            refused: bool = False, sharded: bool = True, traced: bool = False,
            written: str = "") -> list[str]:
    """``traced``: the event holds the replay of its batch (replay_on_nan=True), covering the
    op: replaying again would show the same. ``written``: the replay was refused because an
    input of the batch was written in place since, by the model's own forward ("model": a cache
    it fills in place) or after the batch ("caller")."""
    if traced:
        return [f"Read the replay already made of batch {batch}: event.trace.report() shows "
                "where the NaN/Inf came from and the ops it went through, and event.trace.ops "
                "holds every op's range and line, so the values leading to it can be compared "
                "with what the code expects there."]
    if written == "model":  # w.replay(batch) would be refused the same way
        return [f"Batch {batch} cannot run again as it ran: the model wrote one of its inputs "
                "in place (a cache it fills as it runs, such as Mamba's conv and SSM states or "
                "a static KV cache). To see every op, run the same inputs again through the "
                "watched model without the cache (its forward with use_cache=False: "
                "model(input_ids, use_cache=False) for a language model; for generate(), the "
                "prompt and the tokens generated before that step) and replay that batch: "
                "w.replay(w.batch - 1).report() names the first op that made a NaN/Inf and its "
                "line."]
    if written == "caller":
        return [f"Batch {batch} cannot run again as it ran: one of its input tensors was "
                "changed in place after it. Give each batch its own tensor (or clone() it "
                "before changing it), then w.replay(batch).report() names the first op that "
                "made a NaN/Inf and its line."]
    if refused and not sharded:  # the batch cannot run again (an input written since)
        return ["Watch in full mode (nw.watch(model), without mode='sentinel'): it records "
                "every module's frames as the batch runs, so the module and tensor where the "
                "NaN/Inf first appears are named without a replay."]
    if refused:  # this process alone cannot run the model (FSDP2, tensor parallel)
        return [f"Run batch {batch} through an unsharded copy of the model (the same weights) in "
                f"one process, watched: w.replay({batch}).report() there names the first op that "
                "made a NaN/Inf and its line."]
    if replayable and backward:
        return [f"Replay the batch with its loss to see every op of the backward pass: "
                f"w.replay({batch}, loss_fn=...).report() names the first op that made a "
                "NaN/Inf and its line.",
                "Watch with loss_fn=... (and replay_on_nan=True) to have it done at the event."]
    if replayable:
        return [f"Replay the batch to see every op: w.replay({batch}).report() names the first "
                "op that made a NaN/Inf and its line.",
                "Watch with replay_on_nan=True (and loss_fn=...) to have it done at the event."]
    return ["Keep the batch for a replay (keep_batches >= 1, the default) and replay it: "
            f"w.replay({batch}).report() names the op and its line."]



# Training wrappers set some of these through their own flags, callbacks and parameters: the
# fixes above in their words, where they name what the wrapper does for the user. Each table:
# (text of a fix, the wrapper's text); the first pair found in a fix is applied, then the plain
# clip_grad_norm_ call if it is still there.
_CLIP = "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)"
_FABRIC_CLIP = "fabric.clip_gradients(model, optimizer, max_norm=1.0)"
_SKORCH_CLIP = "callbacks=[skorch.callbacks.GradientNormClipping(gradient_clip_value=1.0)]"
# Lightning Fabric sets the precision with its flag (Fabric(precision="bf16-mixed")), runs the
# autocast and the GradScaler itself, and clips through fabric.clip_gradients (which unscales
# first).
FABRIC_TERMS = (
    ("; or autocast with dtype=torch.bfloat16.",
     '; or train in bfloat16: Fabric(precision="bf16-mixed").'),
    ("Autocast in bfloat16 instead of float16: torch.autocast(device_type, "
     "dtype=torch.bfloat16) has float32's range",
     'Train in bfloat16 instead of float16: Fabric(precision="bf16-mixed") has float32\'s '
     "range"),
    ("Under AMP, let torch.amp.GradScaler manage the loss scale (it lowers the scale when "
     "gradients overflow); a fixed large scale diverges.",
     'In float16, train with Fabric(precision="16-mixed"): its GradScaler manages the loss '
     'scale (it lowers the scale when gradients overflow); or with "bf16-mixed", which needs '
     "none."),
    ("Under AMP, let torch.amp.GradScaler manage the loss scale (it skips a step whose "
     "gradients overflowed and lowers the scale), or train in bfloat16.",
     'In float16, train with Fabric(precision="16-mixed"): its GradScaler skips a step whose '
     'gradients overflowed and lowers the scale; or train in bfloat16 ("bf16-mixed").'),
    ("Keep the weights and optimizer state in float32 (autocast the forward instead of "
     "model.half()).",
     'Keep the weights and optimizer state in float32: Fabric(precision="bf16-mixed") or '
     '"16-mixed" instead of "bf16-true" or "16-true".'),
    ("Keep the weights in float32 and compute in float16 under torch.autocast(device_type, "
     "dtype=torch.float16)",
     'Keep the weights in float32 and compute in float16: Fabric(precision="16-mixed") '
     "instead of \"16-true\""),
    (f"clip them before the step (scaler.unscale_(optimizer), then {_CLIP})",
     f"clip them before the step ({_FABRIC_CLIP}, which unscales them first)"),
    (f"{_CLIP}; with float16, torch.amp.GradScaler skips steps whose gradients hold Inf/NaN.",
     f'{_FABRIC_CLIP}; with precision="16-mixed", its GradScaler skips steps whose gradients '
     "hold Inf/NaN."),
)
# skorch: the net's parameters (lr=..., optimizer__...) and its callbacks.
SKORCH_TERMS = (
    ("Lower the learning rate (try 10x lower) or warm it up over the first steps "
     "(torch.optim.lr_scheduler.LinearLR, or OneCycleLR).",
     "Lower the net's learning rate (try 10x lower: lr= when you make the net, or "
     "net.set_params(lr=...)) or warm it up over the first steps (callbacks=[skorch.callbacks."
     "LRScheduler(policy=torch.optim.lr_scheduler.LinearLR, start_factor=0.1, "
     "total_iters=100, step_every=\"batch\")])."),
    ("so a step divides by ~0. Use eps=1e-4 or larger,",
     "so a step divides by ~0. Use eps=1e-4 or larger (the net's optimizer__eps=1e-4),"),
)
# Stable-Baselines3: the algorithm's constructor arguments (learning_rate=, max_grad_norm=,
# normalize_advantage=) and its environment wrappers; its loss is made inside model.train().
_SB3_CLIP = ("max_grad_norm= when you make the model (PPO, A2C and DQN clip the gradients' "
             "norm by it before each step: 0.5, 0.5 and 10 by default; SAC and TD3 do not "
             "clip)")
SB3_TERMS = (
    ("Lower the learning rate (try 10x lower) or warm it up over the first steps "
     "(torch.optim.lr_scheduler.LinearLR, or OneCycleLR).",
     "Lower the model's learning rate (try 10x lower: learning_rate= when you make it, as in "
     "PPO(\"MlpPolicy\", env, learning_rate=3e-5)), or anneal it: learning_rate= also takes a "
     "function of the progress remaining (learning_rate=lambda progress: 3e-4 * progress)."),
    ("made: missing values, a division by zero or log(0) in preprocessing, a corrupt file.",
     "made: the environment's step() or reset() returned it (a missing sensor value, a "
     "division by zero or log(0) in the env's observation code)."),
)
# Fixes replaced whole for a model SB3 trains: (how the fix begins, the fix in SB3's words).
SB3_WHOLE_FIXES = (
    ("Guard the data: assert torch.isfinite(x).all() in the Dataset",
     "Guard the environment's data: wrap the env in stable_baselines3.common.vec_env."
     "VecCheckNan(env, raise_exception=True), which raises at the step that returned a NaN/Inf "
     "observation or reward (and check a custom Env once with stable_baselines3.common."
     "env_checker.check_env(env)); or clean the observations in a gymnasium.ObservationWrapper "
     "(np.nan_to_num)."),
    ("Name the loss's op and line: watch with loss_fn=",
     "SB3 makes the loss inside model.train(), from the rollout or replay buffer: look at what "
     "it reads besides the policy's outputs: the rewards and observations (wrap the env in "
     "stable_baselines3.common.vec_env.VecCheckNan(env, raise_exception=True)), the "
     "advantages (normalize_advantage=True over a rollout of one sample, n_steps * n_envs == "
     "1, divides by the std() of one value: NaN), and the target network's values (SAC's and "
     "TD3's critic_target, DQN's q_net_target)."),
)
# timm: a loop (train.py's, or one like it) whose NativeScaler runs the backward, the clipping
# and the step in one call, loss_scaler(loss, optimizer, clip_grad=..., parameters=...): there is
# no place between them for a clip_grad_norm_ of one's own, and the GradScaler it holds manages
# the loss scale already. The learning rate and its warmup are create_optimizer_v2's and
# timm.scheduler's (train.py's --lr, --warmup-epochs, --clip-grad).
_TIMM_CLIP = ("loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters()) "
              "(train.py's --clip-grad 1.0; it unscales them first)")
TIMM_TERMS = (
    ("Lower the learning rate (try 10x lower) or warm it up over the first steps "
     "(torch.optim.lr_scheduler.LinearLR, or OneCycleLR).",
     "Lower the learning rate (try 10x lower: create_optimizer_v2(model, lr=...), train.py's "
     "--lr) or warm it up over the first steps (a timm.scheduler scheduler's warmup_t= and "
     "warmup_lr_init=, train.py's --warmup-epochs)."),
    ("Under AMP, let torch.amp.GradScaler manage the loss scale (it lowers the scale when "
     "gradients overflow); a fixed large scale diverges.", ""),
    ("Under AMP, let torch.amp.GradScaler manage the loss scale (it skips a step whose "
     "gradients overflowed and lowers the scale), or train in bfloat16.", ""),
    (f"clip them before the step (scaler.unscale_(optimizer), then {_CLIP})",
     f"clip them before the step: {_TIMM_CLIP}"),
)
# transformers' Trainer: its TrainingArguments set the learning rate, the warmup, the clipping
# (max_grad_norm, on by default at 1.0, which unscales first under fp16) and the precision; the
# NanWatchCallback is its way to check the gradients before each optimizer step.
_TRAINER_CLIP = "TrainingArguments(max_grad_norm=1.0) (its default; max_grad_norm=0 turns it off)"
TRAINER_TERMS = (
    ("Lower the learning rate (try 10x lower) or warm it up over the first steps "
     "(torch.optim.lr_scheduler.LinearLR, or OneCycleLR).",
     "Lower the learning rate (try 10x lower: TrainingArguments(learning_rate=...)) or warm it "
     "up over the first steps (TrainingArguments(warmup_steps=...): a number of steps, or "
     "below 1 a fraction of the training steps)."),
    ("Under AMP, let torch.amp.GradScaler manage the loss scale (it lowers the scale when "
     "gradients overflow); a fixed large scale diverges.",
     "In float16, train with TrainingArguments(fp16=True): its GradScaler manages the loss "
     "scale (it lowers the scale when gradients overflow); or with bf16=True, which needs none."),
    ("Under AMP, let torch.amp.GradScaler manage the loss scale (it skips a step whose "
     "gradients overflowed and lowers the scale), or train in bfloat16.",
     "In float16, train with TrainingArguments(fp16=True): its GradScaler skips a step whose "
     "gradients overflowed and lowers the scale; or train in bfloat16 (bf16=True)."),
    ("Keep the weights and optimizer state in float32 (autocast the forward instead of "
     "model.half()).",
     "Keep the weights and optimizer state in float32: load the model in float32 and train "
     "with TrainingArguments(bf16=True) or fp16=True (mixed precision), not a model loaded "
     "or cast to float16."),
    (f"clip them before the step (scaler.unscale_(optimizer), then {_CLIP})",
     f"clip them before the step: {_TRAINER_CLIP}, which unscales them first"),
    ("so a step divides by ~0. Use eps=1e-4 or larger,",
     "so a step divides by ~0. Use eps=1e-4 or larger (TrainingArguments(adam_epsilon=1e-4)),"),
    ("(a checkpoint: all(v.isfinite().all() for v in state_dict.values()), or a write to ",
     "(a checkpoint the Trainer loaded: train(resume_from_checkpoint=...) or from_pretrained(); "
     "check it with all(v.isfinite().all() for v in safetensors.torch.load_file(path).values())"
     ", or a write to "),
    ("atch the bad step before it writes the weights: watch with backward=True (a non-finite "
     "gradient stops there), or call w.check_grad_norms() before optimizer.step() and skip the "
     "step when it returns True.",
     "atch the bad step before it writes the weights: train with "
     "callbacks=[NanWatchCallback()] (from nanwidget.integrations.transformers), which checks "
     "the gradients before each optimizer step and stops training there."),
    (f"{_CLIP}; with float16, torch.amp.GradScaler skips steps whose gradients hold Inf/NaN.",
     f"{_TRAINER_CLIP}; with fp16=True, its GradScaler skips steps whose gradients hold "
     "Inf/NaN."),
)
# A Trainer that clips already (max_grad_norm > 0, the default): "clip the gradients" is no fix.
_TRAINER_CLIPPING = (
    (f"Clip the gradients before the step: {_CLIP}.",
     "The Trainer already clips the gradients' total norm (TrainingArguments(max_grad_norm="
     "{max_grad_norm:g})), and the weights grew anyway: clipping bounds the gradient, not the "
     "step, so lower learning_rate rather than max_grad_norm."),
    # This run's fix (the run that saved a checkpoint keeps it): clipping is on already, and
    # fp16=True's GradScaler skips steps by itself.
    (f"Clip the gradients before the step: {_CLIP}; with float16, torch.amp.GradScaler skips "
     "steps whose gradients hold Inf/NaN.", ""),
)
# sentence-transformers' SentenceTransformerTrainer is transformers' Trainer (its
# TrainingArguments hold), but the loss is the module given as loss=, which runs the model inside
# its forward: watching that module puts the labels and the loss's ops in the watch.
_ST_WATCH_THE_LOSS = (
    "Name the loss's op and line: watch the loss module rather than the model, nw.watch(loss) "
    "around {call} (the loss{given} runs the model inside its forward, so its labels, its "
    "ops and the model's modules are all watched, one batch per micro-batch).")
ST_TRAINER_WHOLE_FIXES = (
    (NAME_THE_LOSS_OP, _ST_WATCH_THE_LOSS.format(
        call="trainer.train() in place of the callback",
        given=" given as SentenceTransformerTrainer(loss=...)")),)
# sentence-transformers' legacy model.fit(train_objectives=[(loader, loss)]) makes a
# SentenceTransformerTrainer itself: its user sets fit's keywords, not TrainingArguments, and
# cannot pass it a callback.
_ST_FIT_CLIP = "model.fit(max_grad_norm=1) (its default)"
ST_FIT_TERMS = (
    ("Lower the learning rate (try 10x lower) or warm it up over the first steps "
     "(torch.optim.lr_scheduler.LinearLR, or OneCycleLR).",
     "Lower the learning rate (try 10x lower: model.fit(optimizer_params={\"lr\": ...})) or "
     "warm it up over the first steps (model.fit(warmup_steps=...), in steps)."),
    ("Under AMP, let torch.amp.GradScaler manage the loss scale (it lowers the scale when "
     "gradients overflow); a fixed large scale diverges.",
     "In float16, train with model.fit(use_amp=True): its GradScaler manages the loss scale "
     "(it lowers the scale when gradients overflow)."),
    ("Under AMP, let torch.amp.GradScaler manage the loss scale (it skips a step whose "
     "gradients overflowed and lowers the scale), or train in bfloat16.",
     "In float16, train with model.fit(use_amp=True): its GradScaler skips a step whose "
     "gradients overflowed and lowers the scale; or train in bfloat16 with "
     "SentenceTransformerTrainer and SentenceTransformerTrainingArguments(bf16=True)."),
    ("Keep the weights and optimizer state in float32 (autocast the forward instead of "
     "model.half()).",
     "Keep the weights and optimizer state in float32: load the model in float32 and train "
     "with model.fit(use_amp=True) (mixed precision), not a model cast to float16."),
    (f"clip them before the step (scaler.unscale_(optimizer), then {_CLIP})",
     f"clip them before the step: {_ST_FIT_CLIP}, which unscales them first"),
    ("so a step divides by ~0. Use eps=1e-4 or larger, or keep the weights in float32 "
     "(torch.autocast for float16 compute, with torch.amp.GradScaler).",
     "so a step divides by ~0. Use eps=1e-4 or larger (model.fit(optimizer_params={\"lr\": "
     "..., \"eps\": 1e-4})), or keep the weights in float32 (model.fit(use_amp=True) for "
     "float16 compute, with its GradScaler)."),
    ("atch the bad step before it writes the weights: watch with backward=True (a non-finite "
     "gradient stops there), or call w.check_grad_norms() before optimizer.step() and skip the "
     "step when it returns True.",
     "atch the bad step before it writes the weights: train with SentenceTransformerTrainer("
     "..., loss=loss, callbacks=[NanWatchCallback()]) (from nanwidget.integrations."
     "transformers) instead of model.fit, which checks the gradients before each optimizer "
     "step and stops training there."),
    (f"{_CLIP}; with float16, torch.amp.GradScaler skips steps whose gradients hold Inf/NaN.",
     f"{_ST_FIT_CLIP}; with use_amp=True, its GradScaler skips steps whose gradients hold "
     "Inf/NaN."),
)
ST_FIT_WHOLE_FIXES = (
    (NAME_THE_LOSS_OP, _ST_WATCH_THE_LOSS.format(
        call="model.fit(...)", given=" in train_objectives=[(loader, loss)]")),)
_ST_FIT_CLIPPING = (
    (f"Clip the gradients before the step: {_CLIP}.",
     "model.fit clips the gradients' total norm already (max_grad_norm={max_grad_norm:g}), "
     "and the weights grew anyway: clipping bounds the gradient, not the step, so lower the "
     "learning rate (optimizer_params={{\"lr\": ...}}) rather than max_grad_norm."),
    (f"Clip the gradients before the step: {_CLIP}; with float16, torch.amp.GradScaler skips "
     "steps whose gradients hold Inf/NaN.", ""),
)
# Lightning's Trainer: the optimizer and its schedule come from the LightningModule's
# configure_optimizers(), the precision and the clipping from the Trainer's flags
# (gradient_clip_val clips the total norm by default, after the 16-mixed GradScaler unscaled the
# gradients); under manual optimization (automatic_optimization = False) the Trainer does not
# clip, and the module calls self.clip_gradients itself. NanWatchCallback is its way to check
# the gradients before each optimizer step.
_LIGHTNING_CLIP = "Trainer(gradient_clip_val=1.0) (it clips the total norm)"
_LIGHTNING_MANUAL_CLIP = ("self.clip_gradients(optimizer, gradient_clip_val=1.0, "
                          "gradient_clip_algorithm=\"norm\") in training_step, after "
                          "self.manual_backward(loss) and before optimizer.step() (under manual "
                          "optimization the Trainer's gradient_clip_val does not apply)")


def _lightning_terms(clip: str, unscales: str) -> tuple[tuple[str, str], ...]:
    return (
        ("Lower the learning rate (try 10x lower) or warm it up over the first steps "
         "(torch.optim.lr_scheduler.LinearLR, or OneCycleLR).",
         "Lower the learning rate (try 10x lower: the lr of the optimizer that "
         "configure_optimizers() returns; Tuner(trainer).lr_find(model) suggests one) or warm "
         "it up over the first steps: return {\"optimizer\": optimizer, \"lr_scheduler\": "
         "{\"scheduler\": torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, "
         "total_iters=100), \"interval\": \"step\"}} from configure_optimizers()."),
        ("; or autocast with dtype=torch.bfloat16.",
         '; or train in bfloat16: Trainer(precision="bf16-mixed").'),
        ("Autocast in bfloat16 instead of float16: torch.autocast(device_type, "
         "dtype=torch.bfloat16) has float32's range",
         'Train in bfloat16 instead of float16: Trainer(precision="bf16-mixed") has '
         "float32's range"),
        ("Under AMP, let torch.amp.GradScaler manage the loss scale (it lowers the scale when "
         "gradients overflow); a fixed large scale diverges.",
         'In float16, train with Trainer(precision="16-mixed"): its GradScaler manages the '
         'loss scale (it lowers the scale when gradients overflow); or with "bf16-mixed", '
         "which needs none."),
        ("Under AMP, let torch.amp.GradScaler manage the loss scale (it skips a step whose "
         "gradients overflowed and lowers the scale), or train in bfloat16.",
         'In float16, train with Trainer(precision="16-mixed"): its GradScaler skips a step '
         'whose gradients overflowed and lowers the scale; or train in bfloat16 '
         '("bf16-mixed").'),
        ("Keep the weights and optimizer state in float32 (autocast the forward instead of "
         "model.half()).",
         'Keep the weights and optimizer state in float32: Trainer(precision="bf16-mixed") or '
         '"16-mixed" instead of "bf16-true" or "16-true" (or a module cast with .half()).'),
        ("Keep the weights in float32 and compute in float16 under torch.autocast(device_type, "
         "dtype=torch.float16)",
         'Keep the weights in float32 and compute in float16: Trainer(precision="16-mixed") '
         'instead of "16-true"'),
        (f"clip them before the step (scaler.unscale_(optimizer), then {_CLIP})",
         f"clip them before the step ({clip}{unscales})"),
        (f"{_CLIP}; with float16, torch.amp.GradScaler skips steps whose gradients hold Inf/NaN.",
         f'{clip}; with precision="16-mixed", its GradScaler skips steps whose gradients '
         "hold Inf/NaN."),
        ("so a step divides by ~0. Use eps=1e-4 or larger,",
         "so a step divides by ~0. Use eps=1e-4 or larger (in the optimizer that "
         "configure_optimizers() returns),"),
        ("(a checkpoint: all(v.isfinite().all() for v in state_dict.values()), or a write to ",
         "(a checkpoint Lightning loaded: trainer.fit(model, ckpt_path=...) or "
         "load_from_checkpoint(); check it with all(v.isfinite().all() for v in "
         "torch.load(path, weights_only=False)[\"state_dict\"].values()), or a write to "),
        ("atch the bad step before it writes the weights: watch with backward=True (a non-finite "
         "gradient stops there), or call w.check_grad_norms() before optimizer.step() and skip the "
         "step when it returns True.",
         "atch the bad step before it writes the weights: train with "
         "Trainer(callbacks=[NanWatchCallback()]) (from nanwidget.integrations.lightning), which "
         "checks the gradients before each optimizer step and stops training there."),
    )


LIGHTNING_TERMS = _lightning_terms(_LIGHTNING_CLIP, ", which unscales them first")
LIGHTNING_MANUAL_TERMS = _lightning_terms(_LIGHTNING_MANUAL_CLIP, "")
# A Trainer that clips already (gradient_clip_val > 0): "clip the gradients" is no fix.
_LIGHTNING_CLIPPING = (
    (f"Clip the gradients before the step: {_CLIP}.",
     "The Trainer already clips the gradients (Trainer(gradient_clip_val={max_grad_norm:g})), "
     "and the weights grew anyway: clipping bounds the gradient, not the step, so lower the "
     "learning rate rather than gradient_clip_val."),
    (f"Clip the gradients before the step: {_CLIP}; with float16, torch.amp.GradScaler skips "
     "steps whose gradients hold Inf/NaN.", ""),
)
# The loss_fn a watch takes is the callbacks' own keyword: NanWatchCallback(loss_fn=...) passes
# it to the watch, whose replays then run the loss (a replay after the fit has nothing to run:
# the callback closes its watch at the end of training).
def _callback_loss_fn(module: str, made_by: str, output: str) -> tuple[tuple[str, str], ...]:
    return ((NAME_THE_LOSS_OP,
             "Name the loss's op and line: give the callback the loss as a function of the "
             f"model's output, callbacks=[NanWatchCallback(loss_fn=lambda {output}: ...)] (from "
             f"nanwidget.integrations.{module}): it returns the loss {made_by} computes, reading "
             "the batch's targets where that code keeps them, and the watch's replays then run "
             "it and its backward within the failing step."),)


TRAINER_WHOLE_FIXES = _callback_loss_fn(
    "transformers", "your compute_loss_func (or compute_loss, or the Trainer's label smoothing)",
    "outputs")
LIGHTNING_WHOLE_FIXES = _callback_loss_fn("lightning", "training_step", "out")
_CLIPPING = {"trainer": _TRAINER_CLIPPING, "st-trainer": _TRAINER_CLIPPING,
             "st-fit": _ST_FIT_CLIPPING, "lightning": _LIGHTNING_CLIPPING}
_TERMS = {"fabric": (FABRIC_TERMS, _FABRIC_CLIP), "skorch": (SKORCH_TERMS, _SKORCH_CLIP),
          "sb3": (SB3_TERMS, _SB3_CLIP), "trainer": (TRAINER_TERMS, _TRAINER_CLIP),
          "st-trainer": (TRAINER_TERMS, _TRAINER_CLIP), "st-fit": (ST_FIT_TERMS, _ST_FIT_CLIP),
          "lightning": (LIGHTNING_TERMS, _LIGHTNING_CLIP),
          "lightning-manual": (LIGHTNING_MANUAL_TERMS, _LIGHTNING_MANUAL_CLIP),
          "timm": (TIMM_TERMS, _TIMM_CLIP)}
_WHOLE = {"sb3": SB3_WHOLE_FIXES, "trainer": TRAINER_WHOLE_FIXES,
          "st-trainer": ST_TRAINER_WHOLE_FIXES, "st-fit": ST_FIT_WHOLE_FIXES,
          "lightning": LIGHTNING_WHOLE_FIXES, "lightning-manual": LIGHTNING_WHOLE_FIXES}


# The wrappers' words for catching the bad step (TRAINER_TERMS, LIGHTNING_TERMS) suggest
# nanwidget's own callback: pointless where that callback trains the model already (it checked
# the gradients before each step).
_ADD_THE_CALLBACK = "Catch the bad step before it writes the weights: train with "


def without_watch_callback(suggestion: list[str]) -> list[str]:
    """``suggestion`` for a model a wrapper trains with nanwidget's ``NanWatchCallback``
    already: without the fix that says to add it."""
    return [text for text in suggestion
            if not (text.startswith(_ADD_THE_CALLBACK) and "NanWatchCallback()" in text)]


def in_wrapper_terms(suggestion: list[str], wrapper: str,
                     max_grad_norm: float | None = None) -> list[str]:
    """``suggestion`` for a model that a training wrapper runs (``"fabric"``: Lightning
    Fabric, ``"skorch"``, ``"sb3"``: Stable-Baselines3, ``"trainer"``: transformers' Trainer
    (``"st-trainer"``: sentence-transformers' ``SentenceTransformerTrainer``, ``"st-fit"``: the
    one its legacy ``model.fit`` makes, :data:`ST_FIT_TERMS`),
    ``"lightning"``: Lightning's Trainer, ``"lightning-manual"``: the same for a
    LightningModule with ``automatic_optimization = False``; ``"timm"``: a loop whose timm
    ``NativeScaler`` runs the backward and the step, :data:`TIMM_TERMS`), in its words
    (:data:`FABRIC_TERMS`, :data:`SKORCH_TERMS`, :data:`SB3_TERMS` and
    :data:`SB3_WHOLE_FIXES`, :data:`TRAINER_TERMS` and :data:`TRAINER_WHOLE_FIXES`,
    :data:`LIGHTNING_TERMS`, :data:`LIGHTNING_MANUAL_TERMS` and
    :data:`LIGHTNING_WHOLE_FIXES`). ``max_grad_norm``: the Trainer's ``max_grad_norm`` or
    Lightning's ``gradient_clip_val``, when it clips (> 0): a fix that says to clip says that
    it does already."""
    terms, clip = _TERMS[wrapper]
    whole = _WHOLE.get(wrapper, ())
    if wrapper in _CLIPPING and max_grad_norm is not None and max_grad_norm > 0:
        terms = tuple((plain, theirs.format(max_grad_norm=max_grad_norm))
                      for plain, theirs in _CLIPPING[wrapper]) + terms
    worded = []
    for text in suggestion:
        text = next((theirs for begins, theirs in whole if text.startswith(begins)), text)
        for plain, theirs in terms:
            if plain in text:
                text = text.replace(plain, theirs)
                break
        if text:  # a fix the wrapper does already is left out
            worded.append(text.replace(_CLIP, clip))
    return worded


# A run with no float16, bfloat16 or float8 anywhere (weights, activations, no autocast, no
# GradScaler): AMP's fixes name a tool it does not use. The lines that are AMP's only (torch's,
# and the wrappers' words for them), and the clauses of a clipping fix that speak of float16.
_AMP_LINES = ("Under AMP, let torch.amp.GradScaler manage the loss scale",
              "In float16, train with ")
_AMP_CLAUSE = re.compile(r"; with (?:float16|fp16=True|use_amp=True|precision=\"16-mixed\"), "
                         r"(?:torch\.amp\.GradScaler|its GradScaler) skips steps whose gradients "
                         r"hold Inf/NaN\.$")


def in_full_precision(suggestion: list[str]) -> list[str]:
    """``suggestion`` for a run in float32 (or float64) throughout: without AMP's fixes (a
    GradScaler to manage the loss scale, the float16 clause of the clipping fix)."""
    return [_AMP_CLAUSE.sub(".", text) for text in suggestion if not text.startswith(_AMP_LINES)]


# Opacus' DPOptimizer clips each sample's gradient to max_grad_norm and adds Gaussian noise of
# std noise_multiplier x max_grad_norm to their sum: clipping the summed gradient again
# (clip_grad_norm_) bounds nothing it has not bounded.
_CLIP_LINES = ("Clip the gradients before the step: " + _CLIP,
               "In the run that saved it: clip the gradients before the step: " + _CLIP)


def in_dp_terms(suggestion: list[str], kind: str, max_grad_norm: float | None = None,
                noise_multiplier: float | None = None) -> list[str]:
    """``suggestion`` for a model trained with differential privacy (Opacus' ``DPOptimizer``,
    which clips per sample itself): its clipping fix in max_grad_norm's and noise_multiplier's
    words (their values when known). ``kind``: the diagnosis' ("divergence": the steps grew
    the weights; else a step wrote NaN/Inf)."""
    norm = f"max_grad_norm={max_grad_norm:g}" if max_grad_norm is not None else "max_grad_norm"
    noise = ("noise_multiplier x max_grad_norm" if noise_multiplier is None or max_grad_norm is
             None else f"noise_multiplier x max_grad_norm = {noise_multiplier:g} x "
             f"{max_grad_norm:g}")
    said = (f"Opacus' DPOptimizer clips each sample's gradient to {norm} already and adds "
            f"Gaussian noise of std {noise} to their sum, so clip_grad_norm_ adds nothing. ")
    smaller = ("give make_private a smaller max_grad_norm=, which shrinks the clipped "
               "gradients and the noise together (at the same privacy)")
    if kind == "divergence":
        dp = (said + "A step moves the weights by the learning rate times that sum over the "
              "expected batch size: lower the learning rate of the optimizer given to "
              f"make_private, or {smaller}.")
    else:
        huge = noise_multiplier is not None and max_grad_norm is not None \
            and noise_multiplier * max_grad_norm > 1e30
        dp = (said + "With the gradients bounded, a step that wrote NaN/Inf had "
              + ("a noise std past what float32 holds: lower noise_multiplier (make_private("
                 "..., noise_multiplier=...), or a larger target_epsilon in "
                 "make_private_with_epsilon)." if huge else
                 "a learning rate or a noise too large: lower the learning rate, or "
                 f"{smaller}; a lower noise_multiplier spends more privacy."))
    worded = []
    for text in suggestion:
        if text.startswith(_CLIP_LINES):
            if dp not in worded:
                worded.append(dp)
        else:
            worded.append(text.replace(_CLIP, f"{norm} in make_private (Opacus clips per "
                                              "sample)"))
    return worded
