"""The distributed floor: process group and FSDP2 shard plan, meta-device builds, weights read into shards."""
