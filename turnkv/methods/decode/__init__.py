"""The decode-selection axis: which kept tokens a decode step reads, without evicting them."""
