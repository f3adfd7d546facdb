"""One decoder for the Llama / Qwen2 / Qwen3 families, and HF checkpoint read/write."""
from furlong.models.decoder import AttnInputs, Transformer
from furlong.models.hf_config import ModelArgs
from furlong.models.hf_io import hf_name, hf_state_dict, load_pretrained, save_hf

__all__ = ["AttnInputs", "ModelArgs", "Transformer", "hf_name", "hf_state_dict", "load_pretrained", "save_hf"]
