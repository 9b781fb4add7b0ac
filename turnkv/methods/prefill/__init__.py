"""The prefill-pattern axis: what each new query attends to while a turn is prefilled."""
