"""Resource claims: prepare/unprepare, the checkpoint, CDI specs for claimed devices."""
