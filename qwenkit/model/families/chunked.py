"""The chunk-loss machinery every family's subclass shares: the head, the forward's steps, the guards.

A family's subclass is ``class QwenkitX(ChunkLossMixin, XForConditionalGeneration)`` plus
:func:`qwenkit.model.families.subclass.finish_subclass`. It keeps HF's state-dict keys. With ``chunk_loss`` off its forward *is*
HF's. With it on:

1. the HF multimodal backbone ``self.model(...)`` runs as HF runs it (vision tower, placeholder
   scatter, the family's mRoPE, DeepStack) and returns ``last_hidden_state [B, S, H]``;
2. hidden states, labels and the loss function go to **the lm_head module itself**, so FSDP2's
   pre-forward hook gathers ``lm_head.weight`` once for all chunks;
3. :mod:`qwenkit.model.losses.cross_entropy` computes the loss chunk by chunk; ``[B, S, V]`` logits never exist;
   a family with a router adds its auxiliary loss as HF's forward does (:meth:`_aux_loss`).

What differs between families is in the subclass's few overrides: :meth:`vision_tower` (what the
tower returns), :meth:`_decoder_visual_kwargs` (DeepStack's inputs to the decoder under SP) and
:meth:`_aux_loss`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging

import torch
import torch.nn.functional as F
from torch import nn

from qwenkit.config import LOSS_TYPES, chunk_size_problem
from qwenkit.model.families.mtp import draft_agreement, mtp_loss
from qwenkit.model.families.positions import Positions
from qwenkit.model.losses.cross_entropy import (
    IGNORE_INDEX,
    TOKEN_SUM,
    chunked_linear_cross_entropy,
    full_cross_entropy,
    shift_labels,
)
from qwenkit.model.losses.logps import sequence_logps, token_logps, unpack

log = logging.getLogger(__name__)

class ChunkedLMHead(nn.Linear):
    """``nn.Linear`` that, given labels and a loss function, returns the loss instead of logits.

    Called as ``lm_head(hidden)`` it is a plain linear layer (HF's non-chunk path, generation).
    The parameter stays ``weight``, so checkpoints and tied embeddings are unchanged; a bias,
    when the checkpoint has one, goes into the loss like ``F.linear``'s. ``skip_ignored``: project
    only positions with a label (same loss and gradients; False projects every position, the
    benchmarks' reference).
    """

    skip_ignored = True

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, loss_fn=None) -> torch.Tensor:
        if loss_fn is None:
            return F.linear(hidden, self.weight, self.bias)
        return loss_fn(hidden, self.weight, labels, bias=self.bias, skip_ignored=self.skip_ignored)


class ChunkLossMixin(Positions):
    """A family's HF class whose training loss can be computed without full logits (``chunk_loss``)."""

    output_class: type  # HF's output class of the parent's forward (set by the family module)
    _parent_params: list[inspect.Parameter]  # the parent's forward parameters (qwenkit.model.families.subclass.finish_subclass)

    def __init__(self, config):
        super().__init__(config)
        old = self.lm_head
        head = ChunkedLMHead(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
        head.weight = old.weight  # same Parameter object: ties and initialisation carry over
        if old.bias is not None:
            head.bias = old.bias
        self.lm_head = head
        self.chunk_loss = False
        self.chunk_size: int | str = "auto"
        self.chunk_budget_bytes = 512 * 2**20
        # qwenkit's own name: HF's PreTrainedModel.loss_type picks HF's loss_function
        self.qwenkit_loss_type = "token_mean"
        # Data parallel: every rank must run the (sharded) vision tower as many times in every
        # forward (training and eval loss), or FSDP's collectives mismatch when one rank's
        # micro-batch has no image. HF runs the tower once per modality present (images, then
        # videos), so this is 1, or 2 for data with videos; idle calls stand in for a missing
        # modality. 0: no padding (one process). Set by the trainer.
        self.vision_calls_per_step = 0
        # Sequence parallelism: this rank's group (``qwenkit.distributed.sequence.SequenceParallel``),
        # whose slice the forward then runs (:mod:`qwenkit.model.parallel`); None: off.
        self.sequence_parallel = None

    def configure_loss(
        self,
        chunk: bool = True,
        chunk_size: int | str = "auto",
        loss_type: str = "token_mean",
        chunk_budget_mb: int = 512,
    ):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        if problem := chunk_size_problem(chunk_size):
            raise ValueError(problem)
        self.chunk_loss, self.chunk_size, self.qwenkit_loss_type = chunk, chunk_size, loss_type
        self.chunk_budget_bytes = chunk_budget_mb * 2**20
        return self

    def check_chunk_args(self, labels, shifted, use_cache, logits_to_keep, loss_type) -> None:
        """The chunk loss's guards: labels required, no cache, every position, a reduced loss."""
        if labels is None and shifted is None:
            raise ValueError(
                "chunk loss needs labels (or shift_labels): it returns a loss, not logits "
                "(set chunk_loss=False to get logits)"
            )
        if use_cache:
            raise ValueError("chunk loss needs use_cache=False: no KV cache is kept in training")
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError(f"chunk loss needs logits_to_keep=0, got {logits_to_keep!r}")
        if loss_type == "raw":
            raise ValueError("loss_type='raw' (unreduced per-token loss) is not available with chunk loss")

    def forward(
        self,
        *args,
        return_dict: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        num_samples: int | torch.Tensor | None = None,
        packed_seq_lens: torch.Tensor | None = None,
        loss_type: str | None = None,
        **kwargs,
    ):
        """HF's forward, or (``chunk_loss``) backbone + chunked loss head.

        Takes the parent's parameters, by name or in the parent's positional order (its
        signature is the parent's, see :func:`qwenkit.model.families.subclass.finish_subclass`), plus these keywords:
        ``num_items_in_batch``: valid label tokens of the global batch (all ranks and
        accumulation steps) for ``token_mean``; ``num_samples``: samples of the global batch
        for ``sample_mean``. Both default to this batch's own counts. ``packed_seq_lens``: the
        sample lengths of a packed row (see :mod:`qwenkit.data.collator`); the positions are
        then computed per sample (:meth:`~qwenkit.model.families.positions.Positions.packed_position_ids`). ``loss_type``: this call's loss
        type instead of the configured one (evaluation asks for ``token_sum``).
        """
        if loss_type is None:
            loss_type = self.qwenkit_loss_type
        elif loss_type not in (*LOSS_TYPES, TOKEN_SUM):
            raise ValueError(f"loss_type must be one of {(*LOSS_TYPES, TOKEN_SUM)}, got {loss_type!r}")
        if args:
            kwargs = self._bind_positional(args, kwargs)
        input_ids = kwargs.pop("input_ids", None)
        labels = kwargs.pop("labels", None)
        use_cache = kwargs.pop("use_cache", None)
        logits_to_keep = kwargs.pop("logits_to_keep", 0)
        kwargs = self._drop_unsupported(kwargs, input_ids)
        if self.sequence_parallel is not None:  # this rank's slice of the sequence (its own steps)
            out = _slice_steps().forward_slice(self, self.sequence_parallel, input_ids, labels, use_cache, logits_to_keep,
                                               loss_type, num_items_in_batch, num_samples, packed_seq_lens, kwargs)  # fmt: skip
            return out.to_tuple() if return_dict is False else out
        if packed_seq_lens is not None:
            use_cache = self._packed_inputs(input_ids, packed_seq_lens, use_cache, kwargs)
        idle = self._idle_vision(input_ids, kwargs)
        self._packed_seq_lens = packed_seq_lens  # the MTP layer's document boundaries (qwenkit.model.families.mtp)
        step = self._chunked_forward if self.chunk_loss else self._hf_forward
        out = step(input_ids, labels, use_cache, logits_to_keep, loss_type, num_items_in_batch, num_samples, kwargs)
        if idle is not None and out.loss is not None:
            out.loss = out.loss + idle
        if return_dict is not False:
            return out
        if self.chunk_loss:  # HF's positions: to_tuple() would drop the None logits, so keep their place
            names = [f.name for f in dataclasses.fields(out)]
            at = sum(1 for k in out.keys() if names.index(k) < names.index("logits"))  # (loss, [aux_loss,] logits, ...)
            rest = out.to_tuple()
            return (*rest[:at], None, *rest[at:])
        return out.to_tuple()

    def _packed_inputs(self, input_ids, packed_seq_lens, use_cache, kwargs) -> bool:
        """Step 1 (packed rows): per-sample positions into ``kwargs``; returns ``use_cache`` (False)."""
        if use_cache:
            raise ValueError("a packed row needs use_cache=False: with a KV cache transformers ignores the packing")
        kwargs["position_ids"] = self.packed_position_ids(input_ids, packed_seq_lens, kwargs)
        return False  # HF's default (config.use_cache) would build a cache and an unpacked causal mask

    def _idle_vision(self, input_ids, kwargs) -> torch.Tensor | None:
        """Step 2 (data parallel): the zero-valued idle vision-tower calls this rank owes, or None.

        Ranks with images run embed_tokens, then the vision tower, then the decoder; a rank short
        of a modality must issue FSDP's collectives in that same order, so it embeds first.
        """
        missing = self.idle_vision_calls(kwargs)
        if not missing or input_ids is None or kwargs.get("inputs_embeds") is not None:
            return None
        kwargs["inputs_embeds"] = self.model.get_input_embeddings()(input_ids)
        return sum(self.idle_vision_term() for _ in range(missing))

    def chunk_loss_fn(self, shifted, loss_type, num_items_in_batch, num_samples):
        """The loss the lm_head module is handed (:func:`chunked_linear_cross_entropy` at this model's chunking),
        normalised by ``num_items_in_batch`` / ``num_samples``; ``shifted``: pre-shifted labels or None."""
        return functools.partial(chunked_linear_cross_entropy, shifted=shifted, loss_type=loss_type,
                                 chunk_size=self.chunk_size, chunk_budget_bytes=self.chunk_budget_bytes,
                                 num_items_in_batch=num_items_in_batch, num_samples=num_samples)  # fmt: skip

    def _chunked_forward(self, input_ids, labels, use_cache, logits_to_keep, loss_type, num_items_in_batch, num_samples, kwargs):
        """Step 3 (chunk loss): HF's multimodal backbone, then the loss from the lm_head module itself."""
        # pre-shifted labels (sequence parallelism): used as given, as HF's ForCausalLMLoss does
        shifted = kwargs.pop("shift_labels", None)
        self.check_chunk_args(labels, shifted, use_cache, logits_to_keep, loss_type)
        self._prepare_backbone(kwargs)
        outputs = self.model(input_ids=input_ids, use_cache=False, return_dict=True, **kwargs)
        loss_fn = self.chunk_loss_fn(shifted, loss_type, num_items_in_batch, num_samples)
        loss = self.lm_head(outputs.last_hidden_state, labels=labels, loss_fn=loss_fn)
        loss = self.with_mtp_loss(loss, outputs.last_hidden_state, input_ids, labels, self._packed_seq_lens, loss_fn, loss_type)
        loss, aux = self._with_aux_loss(loss, outputs, kwargs.get("attention_mask"), loss_type)
        # HF's output class with HF's fields (hidden states, attentions, rope deltas / media
        # outputs, router logits, by version) taken from the backbone as its forward does; logits never exist
        rest = {f.name: getattr(outputs, f.name, None) for f in dataclasses.fields(self.output_class)}
        return self.output_class(**{**rest, "loss": loss, "logits": None, **({"aux_loss": aux} if aux is not None else {})})

    def with_mtp_loss(self, loss, hidden, input_ids, labels, packed_seq_lens, loss_fn, loss_type, view=None):
        """``loss`` plus the weighted MTP loss (``model.mtp.train``, Qwen3.5: :func:`~qwenkit.model.families.mtp.mtp_loss`,
        its value kept as ``last_mtp_loss``); ``loss`` as is without the layer, or for evaluation's token sums."""
        if getattr(self, "mtp", None) is None or loss_type == TOKEN_SUM:
            return loss
        extra = mtp_loss(self, hidden, input_ids, labels, packed_seq_lens, loss_fn, view)
        self.last_mtp_loss = extra.detach()
        return loss + self.mtp_loss_weight * extra

    def sequence_logps(self, input_ids=None, labels=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sequence ``(sums [B], counts [B])`` of the label log-probs, without logits (preference
        objectives): :func:`qwenkit.model.losses.logps.sequence_logps` as the head's loss function; of a
        packed row (``packed_seq_lens [B]``), its samples' sums of the per-token log-probs; under sequence
        parallelism, the sums of the whole sequence's per-token log-probs, gathered once over the group from
        the slices (:func:`qwenkit.model.parallel.token_logps_slice`, GRPO's path). The counts come from the
        whole labels every rank of the group holds: no collective."""
        packed = kwargs.get("packed_seq_lens")
        if packed is None and self.sequence_parallel is None:
            return self._labelled_head(sequence_logps, input_ids, labels, kwargs)
        logps, _ = self._labelled_head(token_logps, input_ids, labels, kwargs)  # [B, S] or [B, max L], unpacked
        valid = shift_labels(labels) != IGNORE_INDEX  # [B, S]
        return logps.sum(-1), (unpack(valid, packed) if packed is not None else valid).sum(-1)

    def token_logps(self, input_ids=None, labels=None, entropy: bool = False, temperature: float = 1.0,
                    banned: list[int] | None = None, **kwargs):  # fmt: skip
        """Per-token ``(logps [B, S], entropies [B, S] or None)`` of the labels under the logits divided by
        ``temperature``, the ``banned`` tokens excluded, without logits (GRPO): :func:`qwenkit.model.losses.logps.token_logps`
        as the head's loss function. A packed row (``packed_seq_lens [B]``, :mod:`qwenkit.data.collator`) gives
        its samples' values as the right-padded batch of them would (``[B, max L]``,
        :func:`qwenkit.model.losses.logps.unpack`)."""
        head = functools.partial(token_logps, entropy=entropy, temperature=temperature, banned=banned)
        return self._labelled_head(head, input_ids, labels, kwargs)

    def mtp_agreement(self, input_ids=None, labels=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample ``(accepted, drafted)`` positions of the MTP layer's drafts (``model.mtp``;
        :func:`qwenkit.model.families.mtp.draft_agreement`), HF's backbone run as in the chunk-loss forward;
        under FSDP2 a registered forward method, as :meth:`_labelled_head`'s callers."""
        kwargs = self._drop_unsupported({k: v for k, v in kwargs.items() if k != "use_cache"}, input_ids)
        packed = kwargs.pop("packed_seq_lens", None)
        if packed is not None:
            self._packed_inputs(input_ids, packed, False, kwargs)
        self._idle_vision(input_ids, kwargs)  # the collectives a rank short of a modality owes (no loss here)
        self._prepare_backbone(kwargs)
        outputs = self.model(input_ids=input_ids, use_cache=False, return_dict=True, **kwargs)
        return draft_agreement(self, outputs.last_hidden_state, input_ids, labels, packed)

    def _labelled_head(self, head_fn, input_ids, labels, kwargs) -> tuple:
        """HF's backbone as in the chunk-loss forward, then the lm_head module with ``head_fn`` as
        its loss function; the idle vision calls this rank owes join the first output. Under FSDP2
        call the public method as a registered forward method (``register_fsdp_forward_method``):
        the root's hooks gather its parameters only around ``forward`` and registered methods.
        """
        if labels is None:
            raise ValueError("log-probs need labels (the reply tokens whose log-probs are computed)")
        kwargs = self._drop_unsupported({k: v for k, v in kwargs.items() if k != "use_cache"}, input_ids)
        packed = kwargs.pop("packed_seq_lens", None)
        if self.sequence_parallel is not None:  # this rank's slice; the whole sequence's values gathered
            if getattr(head_fn, "func", head_fn) is not token_logps:
                raise ValueError("sequence parallelism gives per-token log-probs of the whole sequence only "
                                 "(sequence_logps sums them)")  # fmt: skip
            first, second = _slice_steps().token_logps_slice(self, self.sequence_parallel, head_fn, input_ids, labels,
                                                             packed, kwargs)  # fmt: skip
            return (unpack(first, packed), unpack(second, packed) if second is not None else None) if packed is not None \
                else (first, second)
        if packed is not None:  # per-sample positions, as the packed loss forward's (and its linear attention's)
            self._packed_inputs(input_ids, packed, False, kwargs)
        idle = self._idle_vision(input_ids, kwargs)
        self._prepare_backbone(kwargs)
        outputs = self.model(input_ids=input_ids, use_cache=False, return_dict=True, **kwargs)
        loss_fn = functools.partial(head_fn, chunk_size=self.chunk_size, chunk_budget_bytes=self.chunk_budget_bytes)
        first, second = self.lm_head(outputs.last_hidden_state, labels=labels, loss_fn=loss_fn)
        if packed is not None:  # token values [1, ΣL] -> [B, max L]
            first, second = unpack(first, packed), (unpack(second, packed) if second is not None else None)
        return (first + idle if idle is not None else first), second

    def _hf_forward(self, input_ids, labels, use_cache, logits_to_keep, loss_type, num_items_in_batch, num_samples, kwargs):
        """Step 3 (no chunk loss): HF's own forward; other loss types reduce HF's logits with qwenkit's loss."""
        if loss_type == "token_mean" or labels is None:
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return super().forward(input_ids=input_ids, labels=labels, use_cache=use_cache,
                                   logits_to_keep=logits_to_keep, return_dict=True, **kwargs)
        # sample_mean / token_sum / raw: HF's head gives the logits, qwenkit's reference loss reduces them
        shifted = kwargs.pop("shift_labels", None)
        out = super().forward(input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep,
                              return_dict=True, **kwargs)
        if out.logits.shape[1] != labels.shape[1]:
            raise ValueError(f"loss_type={loss_type!r} needs logits for every position (logits_to_keep=0)")
        out.loss = full_cross_entropy(
            out.logits, labels, loss_type, num_items_in_batch, num_samples, shifted=shifted
        )
        out.loss, _ = self._with_aux_loss(out.loss, out, kwargs.get("attention_mask"), loss_type)
        return out

    # --- what a family overrides -------------------------------------------------------------

    def _prepare_backbone(self, kwargs: dict) -> None:
        """Backbone keywords HF's own forward would add (a router's ``output_router_logits``)."""

    def _aux_loss(self, outputs, attention_mask) -> tuple[torch.Tensor, float] | None:
        """``(auxiliary loss, its weight)`` that HF's forward adds to the training loss (a router's), or None."""
        return None

    def vision_tower(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """``[merged features [tokens, H], *DeepStack features]`` of the vision tower."""
        out = self.model.visual(pixels, grid_thw=grid_thw)
        return [out if torch.is_tensor(out) else out.pooler_output]  # 4.57 returns the tensor, 5.x an output

    def _decoder_visual_kwargs(self, visual_mask: torch.Tensor, extra: list[torch.Tensor]) -> dict:
        """The decoder's keywords for this slice's visual positions (DeepStack's, under SP)."""
        return {}

    # --- shared helpers ------------------------------------------------------------------------

    def _with_aux_loss(self, loss, outputs, attention_mask, loss_type: str):
        """``(loss, aux loss or None)``: HF adds the router's weighted loss to the training loss;
        evaluation's token sums stay pure cross-entropy."""
        if loss_type == TOKEN_SUM or loss is None:
            return loss, None
        if (found := self._aux_loss(outputs, attention_mask)) is None:
            return loss, None
        aux, weight = found
        return loss + weight * aux.to(loss.device), aux

    def idle_vision_calls(self, kwargs) -> int:
        """Vision-tower calls this rank must add so that every rank makes the same number."""
        made = (kwargs.get("pixel_values") is not None) + (kwargs.get("pixel_values_videos") is not None)
        return max(0, self.vision_calls_per_step - made)  # training and eval loss alike

    def blank_vision_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One blank merged patch group ``(pixels, grid)``: the smallest legal tower input."""
        visual = self.model.visual
        m = visual.spatial_merge_size
        pe = visual.patch_embed
        width = pe.in_channels * pe.temporal_patch_size * pe.patch_size**2
        param = next(visual.parameters())
        pixels = torch.zeros(m * m, width, device=param.device, dtype=param.dtype)
        return pixels, torch.tensor([[1, m, m]], device=param.device)

    def idle_vision_term(self) -> torch.Tensor:
        """0 x (vision tower on one blank patch group): same collectives on every rank, no effect.

        Every output (DeepStack's too) joins the term, so every sharded module of the tower
        takes part in backward on every rank.
        """
        return sum(t.sum() for t in self.vision_tower(*self.blank_vision_input())) * 0.0

    def _bind_positional(self, args: tuple, kwargs: dict) -> dict:
        """Positional arguments by the parent's order (``model(input_ids, attention_mask)`` as in HF)."""
        params = self._parent_params
        if len(args) > len(params):
            raise TypeError(f"forward() takes at most {len(params)} positional arguments, got {len(args)}")
        kwargs = dict(kwargs)
        for param, value in zip(params, args):
            if param.name in kwargs:
                raise TypeError(f"forward() got multiple values for argument {param.name!r}")
            kwargs[param.name] = value
        return kwargs

    def _drop_unsupported(self, kwargs: dict, input_ids: torch.Tensor | None = None) -> dict:
        """The batch's keywords as this family's forward takes them (``input_ids``: the batch's, for a family that
        reads a flag off them): on 4.57, drop ``mm_token_type_ids`` instead of leaking it into the attention kwargs."""
        if "mm_token_type_ids" in kwargs and not self.takes_token_types():
            kwargs = {k: v for k, v in kwargs.items() if k != "mm_token_type_ids"}
        return kwargs


def _slice_steps():
    """:mod:`qwenkit.model.parallel`, the forward on a sequence-parallel slice, imported when a model runs one."""
    from qwenkit.model import parallel  # the SP steps; imports nothing back

    return parallel
