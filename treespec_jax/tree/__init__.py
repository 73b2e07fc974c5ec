"""Pure, jit-able tree pieces: selection, ancestor masks, verify walks, TreeSpec."""
