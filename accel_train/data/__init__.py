"""Data: what a data set is (DataInfo), its readers (CIFAR-10 batches, image folders, random data),
augmentation and the loaders.

Modules: info (DataInfo), cifar, folders (an image folder's splits), images (reading and decoding
image files), synthetic (random data), augment, crops, train_augment, load (splits, the pipeline's
choice), pipeline (build_data), workers, cache (the decoded cache), given (your own Datasets).
"""

from .augment import crop_flip, crop_flip_params
from .cifar import read_batch, read_cifar10
from .given import given_data
from .images import check_images, decode_all, decode_image, native_size
from .info import CIFAR10, DataError, DataInfo
from .load import device_budget
from .pipeline import Data, build_data, set_loader_epoch
from .synthetic import random_data

__all__ = [
    "CIFAR10",
    "Data",
    "DataError",
    "DataInfo",
    "build_data",
    "check_images",
    "crop_flip",
    "crop_flip_params",
    "decode_all",
    "decode_image",
    "device_budget",
    "given_data",
    "native_size",
    "random_data",
    "read_batch",
    "read_cifar10",
    "set_loader_epoch",
]
