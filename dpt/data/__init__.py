"""Data: the data sets dpt ships (synthetic, fake images, COCO, image folders, shards), image
decoding and transforms, the shard writer and cache, and the loaders that shard one global order
over the ranks and resume at a sample.

May import: base.
"""
