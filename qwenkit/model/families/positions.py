"""A family model's positions: transformers' token types and mRoPE, and a packed row's per-sample positions.

:class:`Positions` is a base of :class:`qwenkit.model.families.chunked.ChunkLossMixin`, so every family's
subclass has these methods; the chunk-loss forward (packed rows), the sequence-parallel slice
(:mod:`qwenkit.model.parallel`) and the tests call them on the model. They read the family's own
``get_rope_index`` (HF's), never compute mRoPE themselves. The Omni thinkers' ``get_rope_index`` reads
two keywords more (:func:`thinker_keywords`), which their forward and HF's ``generate`` get alike.
"""

from __future__ import annotations

import inspect

import torch


def heard_video(config, input_ids: torch.Tensor | None) -> bool:
    """Whether ``input_ids`` hold a video span with its audio track: ``<vision_start>`` right before the audio
    start token, which only HF's ``use_audio_in_video`` layout writes (:func:`qwenkit.data.audio.video_span`)."""
    if input_ids is None:
        return False
    starts = input_ids[..., :-1] == config.vision_start_token_id
    return bool((starts & (input_ids[..., 1:] == config.audio_start_token_id)).any())


def thinker_keywords(config, kwargs: dict, input_ids: torch.Tensor | None) -> dict:
    """``kwargs`` as a thinker's forward reads them, and HF's ``generate``, which places a prompt's positions from
    them before the forward: the batch's ``second_per_grid_ts`` (the collator's name, Qwen2.5-VL's) as
    ``video_second_per_grid``, the seconds per temporal patch its mRoPE times video frames by; and
    ``use_audio_in_video=True`` when ``input_ids`` hold a heard video (unless the caller says)."""
    kwargs = dict(kwargs)
    if "second_per_grid_ts" in kwargs:
        kwargs["video_second_per_grid"] = kwargs.pop("second_per_grid_ts")
    if kwargs.get("use_audio_in_video") is None and heard_video(config, input_ids):
        kwargs["use_audio_in_video"] = True
    return kwargs


class Positions:
    """Positions of a family model's batch, from its own ``get_rope_index``."""

    def token_types(self, ids: torch.Tensor) -> torch.Tensor:
        """transformers 5.x token types (0 text, 1 image, 2 video) when the batch has none."""
        return (ids == self.config.image_token_id).long() + 2 * (ids == self.config.video_token_id).long()

    def takes_token_types(self) -> bool:
        """Whether this transformers version's backbone reads ``mm_token_type_ids`` (5.x; 4.57 does not)."""
        return "mm_token_type_ids" in inspect.signature(type(self.model).forward).parameters

    def rope_index(self, input_ids, attention_mask=None, media: dict | None = None) -> torch.Tensor:
        """mRoPE positions ``[3, B, S]`` from the model's own ``get_rope_index``."""
        media = media or {}
        kwargs = {k: media.get(k) for k in ("image_grid_thw", "video_grid_thw")}
        if media.get("second_per_grid_ts") is not None:  # Qwen2.5-VL's video time; Qwen3-VL writes timestamps
            kwargs["second_per_grid_ts"] = media["second_per_grid_ts"]
        if self.takes_token_types():
            types = media.get("mm_token_type_ids")
            kwargs["mm_token_type_ids"] = types if types is not None else self.token_types(input_ids)
        pos, _ = self.model.get_rope_index(input_ids, attention_mask=attention_mask, **kwargs)
        return pos

    def packed_position_ids(self, input_ids: torch.Tensor, seq_lens: torch.Tensor, media: dict) -> torch.Tensor:
        """Positions ``[4, 1, ΣL]`` of a packed row: ``[text; t; h; w]``, each sample starting at 0.

        The t/h/w rows of each sample come from the model's own ``get_rope_index`` run on that
        sample alone (its images and videos at whatever offset they sit), so they equal the
        unpacked sample's. The text row is ``0 .. L-1`` per sample: transformers (4.57 and 5.x)
        reads a 4-row ``position_ids`` as packed, finds the sample boundaries where the text
        row does not step by 1 (``masking_utils.find_packed_sequence_indices``) and builds a
        block-causal mask (sdpa, eager) or varlen boundaries (flash attention) from it; the
        packed row must therefore come without an ``attention_mask``.
        """
        if input_ids is None or input_ids.shape[0] != 1:
            raise ValueError("packed_seq_lens needs input_ids of one packed row [1, sum(lengths)]")
        if media.get("attention_mask") is not None:
            raise ValueError("a packed row takes no attention_mask: the block mask comes from the positions")
        lengths = seq_lens.tolist()
        if sum(lengths) != input_ids.shape[1]:
            raise ValueError(f"packed_seq_lens sum to {sum(lengths)}, but the row has {input_ids.shape[1]} tokens")
        cfg, merge = self.config, self.config.vision_config.spatial_merge_size
        grids = {
            cfg.image_token_id: list(media.get("image_grid_thw") if media.get("image_grid_thw") is not None else []),
            cfg.video_token_id: list(media.get("video_grid_thw") if media.get("video_grid_thw") is not None else []),
        }
        seconds = media.get("second_per_grid_ts")
        seconds = list(seconds) if seconds is not None else None
        types = media.get("mm_token_type_ids")
        rows, start = [], 0
        for length in lengths:
            ids = input_ids[:, start : start + length]  # [1, L]
            mine = {}  # this sample's grids: as many as cover its placeholder tokens
            for token, queue in grids.items():
                need, taken = int((ids == token).sum()), []
                while need > 0:
                    if not queue:
                        raise ValueError("packed row: fewer image/video grids than placeholder tokens")
                    taken.append(queue.pop(0))
                    need -= int(taken[-1].prod()) // merge**2
                mine[token] = torch.stack(taken) if taken else None
            sample = {"image_grid_thw": mine[cfg.image_token_id], "video_grid_thw": mine[cfg.video_token_id]}
            if mine[cfg.video_token_id] is not None and seconds is not None:
                n = len(mine[cfg.video_token_id])
                sample["second_per_grid_ts"] = torch.stack(seconds[:n])
                seconds = seconds[n:]
            if types is not None:
                sample["mm_token_type_ids"] = types[:, start : start + length]
            mrope = self.rope_index(ids, media=sample)  # [3, 1, L]
            text = torch.arange(length, device=ids.device, dtype=mrope.dtype).view(1, 1, -1)
            rows.append(torch.cat([text, mrope]))  # [4, 1, L]
            start += length
        return torch.cat(rows, dim=2)  # [4, 1, ΣL]
