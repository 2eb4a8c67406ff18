"""jax_flash: FlashAttention for JAX on CPUs and NVIDIA GPUs."""

from jax_flash.api import attention as attention
from jax_flash.api import dot_product_attention as dot_product_attention
from jax_flash.ffi import cuda_kernels_available as cuda_kernels_available

__version__ = "0.1.0"
