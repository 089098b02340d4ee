use super::*;

#[test]
fn a100_orders_the_calls_as_published() {
    let p = Profile::a100();
    assert!(p.cost(Call::Create) > p.cost(Call::SetAccess));
    assert!(p.cost(Call::SetAccess) > p.cost(Call::Unmap));
    assert!(p.cost(Call::Unmap) > p.cost(Call::Map));
    assert!(!p.is_none() && Profile::none().is_none());
}

#[test]
fn h200_split_adds_up_to_the_measured_totals() {
    let p = Profile::h200();
    let us = |c| p.cost(c).as_secs_f64() * 1e6;
    let per_page = us(Call::Map) + us(Call::SetAccess) + us(Call::Unmap);
    assert!((per_page - 53.3).abs() < 0.1, "{per_page}");
    let per_run = us(Call::Map) + us(Call::Unmap) + us(Call::SetAccess) / 32.0;
    assert!((per_run - 33.5).abs() < 0.1, "{per_run}");
    // 2 MiB at 55 GB/s.
    let t = p.copy_time(Direction::HostToDevice, 2 << 20);
    assert!((t.as_secs_f64() * 1e6 - 38.1).abs() < 0.1, "{t:?}");
    assert!(p.copy_time(Direction::DeviceToDevice, 1 << 30).is_zero());
}

#[test]
fn every_call_has_its_own_slot_and_key() {
    for (i, call) in Call::ALL.into_iter().enumerate() {
        assert_eq!(call.index(), i);
        assert_eq!(
            Call::ALL.iter().filter(|c| c.key() == call.key()).count(),
            1
        );
    }
}

#[test]
fn names_and_files_parse() {
    assert_eq!(Profile::parse("none").unwrap(), Profile::none());
    assert_eq!(Profile::parse("a100").unwrap(), Profile::a100());
    let p =
        Profile::parse_file("base=h200\n# a comment\ncreate = 50 # µs\nd2d_gbps=1000\n").unwrap();
    assert_eq!(p.cost(Call::Create), Duration::from_micros(50));
    assert_eq!(p.cost(Call::Map), Profile::h200().cost(Call::Map));
    assert_eq!(p.bandwidth(Direction::DeviceToDevice), Some(1e12));
    for bad in ["map", "map=x", "map=-1", "warp=3", "base=v100"] {
        assert!(Profile::parse_file(bad).is_err(), "{bad}");
    }
    let err = Profile::parse("/nonexistent/profile").unwrap_err();
    assert!(err.contains("neither none"), "{err}");
}

#[test]
fn a_charged_call_takes_at_least_its_cost() {
    let mut p = Profile::none();
    p.set(Call::Create, Duration::from_micros(300));
    p.set(Call::Map, Duration::from_micros(20));
    let c = Charger::new(p);
    let t = Instant::now();
    c.call(Call::Create);
    let create = t.elapsed();
    let t = Instant::now();
    c.call(Call::Map);
    let map = t.elapsed();
    // Orders only: never less than the cost (a timer never runs early).
    assert!(create >= Duration::from_micros(300), "{create:?}");
    assert!(map >= Duration::from_micros(20), "{map:?}");
    let t = Instant::now();
    c.call(Call::Unmap);
    assert!(
        t.elapsed() < Duration::from_millis(50),
        "an uncharged call returns at once"
    );
}

#[test]
fn a_profile_file_is_read_by_path() {
    let path = std::env::temp_dir().join(format!("strata-latency-{}.txt", std::process::id()));
    std::fs::write(&path, "base=a100\nunmap=2\nh2d_gbps=0\n").unwrap();
    let p = Profile::parse(path.to_str().unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(p.name, path.to_str().unwrap());
    assert_eq!(p.cost(Call::Create), Profile::a100().cost(Call::Create));
    assert_eq!(p.cost(Call::Unmap), Duration::from_micros(2));
    assert_eq!(
        p.bandwidth(Direction::HostToDevice),
        None,
        "0 turns charging off"
    );
}
