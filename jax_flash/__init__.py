"""jax_flash: FlashAttention for JAX on CPUs and NVIDIA GPUs."""

from jax_flash.api import attention as attention
from jax_flash.api import dot_product_attention as dot_product_attention
from jax_flash.api import varlen_attention as varlen_attention
from jax_flash.ffi import cuda_kernels_available as cuda_kernels_available
from jax_flash.mla import mla_decode as mla_decode
from jax_flash.paged import paged_attention as paged_attention
from jax_flash.paged import write_paged_cache as write_paged_cache
from jax_flash.ring import from_zigzag as from_zigzag
from jax_flash.ring import ring_attention as ring_attention
from jax_flash.ring import ring_attention_sharded as ring_attention_sharded
from jax_flash.ring import to_zigzag as to_zigzag

__version__ = "0.1.0"
