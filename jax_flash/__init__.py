"""jax_flash: FlashAttention for JAX on CPUs and NVIDIA GPUs."""

from jax_flash._api import attention as attention
from jax_flash._api import dot_product_attention as dot_product_attention
from jax_flash._api import varlen_attention as varlen_attention
from jax_flash._ffi import cuda_kernels_available as cuda_kernels_available
from jax_flash._fp8 import dequantize_fp8 as dequantize_fp8
from jax_flash._fp8 import fp8_attention as fp8_attention
from jax_flash._fp8 import hadamard_rotate as hadamard_rotate
from jax_flash._fp8 import quantize_fp8 as quantize_fp8
from jax_flash._mla import empty_mla_cache as empty_mla_cache
from jax_flash._mla import mla_decode as mla_decode
from jax_flash._mla import write_mla_cache as write_mla_cache
from jax_flash._mla_fp8 import MlaFp8Cache as MlaFp8Cache
from jax_flash._paged import paged_attention as paged_attention
from jax_flash._paged import write_paged_cache as write_paged_cache
from jax_flash._paged_fp8 import Fp8Pages as Fp8Pages
from jax_flash._ring import from_zigzag as from_zigzag
from jax_flash._ring import ring_attention as ring_attention
from jax_flash._ring import ring_attention_sharded as ring_attention_sharded
from jax_flash._ring import to_zigzag as to_zigzag

__version__ = "0.1.0"
