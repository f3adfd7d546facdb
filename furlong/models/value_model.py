"""The value model of PPO's critic: the decoder with a scalar head (docs/design.md §5).

V(position t) = w · h_t + b, with h_t the decoder's final-normed hidden state at t, so for a
packed sample with P prompt tokens the value of response token j (the state before it is
generated) is read at position P-1+j, where the actor reads that token's log-prob.

As in miles (its critic replaces the output layer by a Linear(hidden, 1) with weights
~ N(0, 0.02) and a zero bias), the head is fresh and the decoder comes from an HF checkpoint;
the LM head is dropped, since the critic never projects to the vocabulary. The head runs in
fp32 on the (possibly bf16) hidden states, so values keep fp32 resolution. verl builds its
critic the same way (a token-classification head with one label).
"""
from __future__ import annotations

import torch
from torch import nn

from furlong.models.decoder import Transformer

HEAD_INIT_STD = 0.02   # miles' critic output layer


class ValueModel(nn.Module):
    def __init__(self, decoder: Transformer, generator: torch.Generator | None = None):
        """`decoder` (its lm_head is removed in place); `generator` seeds the head's init, so that
        every rank (and every world size) starts from the same head."""
        super().__init__()
        decoder.lm_head = None
        self.decoder = decoder
        hidden = decoder.args.hidden_size
        device = decoder.embed_tokens.weight.device
        self.value_head = nn.Linear(hidden, 1, bias=True, device=device, dtype=torch.float32)
        with torch.no_grad():
            w = torch.randn(self.value_head.weight.shape, generator=generator) * HEAD_INIT_STD
            self.value_head.weight.copy_(w)
            self.value_head.bias.zero_()

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (FSDP shards each one; trainer/fsdp.py looks them up here)."""
        return self.decoder.layers

    @property
    def gradient_checkpointing(self) -> bool:
        return self.decoder.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        self.decoder.gradient_checkpointing = on

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> values [...] fp32 (a fresh tensor, not a view: FSDP warns on views)."""
        return hidden.float() @ self.value_head.weight[0].float() + self.value_head.bias.float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> values [B, T] fp32 (attention_mask as Transformer.hidden_states)."""
        return self._head(self.decoder.hidden_states(input_ids, attention_mask=attention_mask))

    def forward_packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """One packed row (Transformer.forward_packed's inputs) -> values [T] fp32."""
        return self._head(self.decoder.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen))
